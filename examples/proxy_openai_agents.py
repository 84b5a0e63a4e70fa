"""Drive the recording proxy with the OpenAI Agents SDK and collect token-exact trajectories.

    python examples/proxy_openai_agents.py [--model tiny]

Needs `openai-agents` (pip install openai-agents) and the transformers engine; it says so and
exits if either is missing. The agent only sees a base_url and an api key, and uses the SDK's
default model, which speaks the Responses API (`/v1/responses`); the SDK's chat-completions
model (`OpenAIChatCompletionsModel`) works the same way.
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
        from agents import (
            Agent,
            AgentsException,
            OpenAIResponsesModel,
            Runner,
            function_tool,
        )
    except ImportError:
        print("skipped: the OpenAI Agents SDK is not installed (pip install openai-agents)")
        return 0
    try:
        from agentrl.engine import create_engine  # type: ignore[attr-defined]
    except ImportError:
        print("skipped: agentrl.engine.create_engine (transformers engine) is not available")
        return 0
    import openai

    from agentrl.models import load_tokenizer
    from servers.agents import run_agents
    from servers.app import create_app
    from servers.config import ProxyConfig

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async def agent(task: str, base_url: str, api_key: str) -> str:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        model = OpenAIResponsesModel(model=args.model, openai_client=client)
        bot = Agent(name="calc", instructions="Use the add tool.", tools=[add], model=model)
        try:
            result = await Runner.run(bot, task, max_turns=3)
        except AgentsException as e:
            # The model misbehaved (too many turns, a malformed tool call): for RL that is an
            # episode like any other, scored by the reward function; the turns are recorded.
            print(f"agent gave up: {type(e).__name__}: {e}", file=sys.stderr)
            return ""
        return str(result.final_output)

    tokenizer = load_tokenizer(args.model)
    app = create_app(create_engine(args.model, tokenizer=tokenizer), tokenizer,
                     config=ProxyConfig(model_name=args.model))
    trajs = asyncio.run(run_agents(agent, ["What is 2 + 3?", "What is 7 + 6?"], app=app,
                                   reward_fn=lambda task, out: float("5" in out or "13" in out)))
    for t in trajs:
        print(f"{t.uid}: {len(t.token_ids)} tokens, {len(t.turns)} turns, reward {t.total_reward}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
