"""Drive the recording proxy with LangChain's ChatOpenAI, one session per episode.

    python examples/proxy_langchain.py [--model tiny]

Needs `langchain-openai` (`pip install -e ".[examples]"`; `make setup` installs it) and the
transformers engine; it says so and exits if either is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    try:
        from langchain_openai import ChatOpenAI
    except ImportError:
        print('skipped: langchain-openai is not installed (pip install -e ".[examples]")')
        return 0
    try:
        from agentrl.engine import create_engine  # type: ignore[attr-defined]
    except ImportError:
        print("skipped: agentrl.engine.create_engine (transformers engine) is not available")
        return 0
    from agentrl.models import load_tokenizer
    from servers.agents import run_agents
    from servers.app import create_app
    from servers.config import ProxyConfig

    def agent(task: str, base_url: str, api_key: str) -> str:  # sync agents run in a thread
        llm = ChatOpenAI(model=args.model, base_url=base_url, api_key=api_key, max_tokens=32)
        first = llm.invoke(task).content
        return str(llm.invoke([("user", task), ("assistant", first), ("user", "Sure?")]).content)

    tokenizer = load_tokenizer(args.model)
    app = create_app(create_engine(args.model, tokenizer=tokenizer), tokenizer,
                     config=ProxyConfig(model_name=args.model))
    trajs = asyncio.run(run_agents(agent, ["Say hi.", "Count to 3."], app=app))
    for t in trajs:
        print(f"{t.uid}: {len(t.turns)} turns, drift={t.info['drift']}, {len(t.token_ids)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
