"""An external agent drives MiniWoB++ through `agentrl serve`: plain `openai` SDK calls, each
turn's screenshot sent as an `image_url` part (a PNG data URL), the episode one session.

    agentrl serve --model embedded-vlm --port 8000 &
    python examples/agents/miniwob_screenshots.py \\
        --base-url http://127.0.0.1:8000/sessions/demo/v1 --task click-button
    curl http://127.0.0.1:8000/sessions/demo/export    # one trajectory holding the screenshots

The agent owns the browser (a `MiniWoBEnv` in screenshot mode, the same page, action grammar
and reward as `agentrl/MiniWoB-v0`); the model behind the proxy sees the task and the
screenshot and answers with an action (`click(x, y)`, `type("text")`, `key("Enter")`, ...).
Every call sends the whole conversation so far, so each extends the one before and the proxy
records the episode as one trajectory, its screenshots at their places; the reward is posted
to the session at the end.

Needs the browser extra and Chromium (`pip install 'agentrl[browser]'`, `apt-get install -y
chromium chromium-driver`).
"""

from __future__ import annotations

import argparse
import base64
import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import openai

from agentrl.http_client import http_client
from environments.miniwob.env import MiniWoBEnv

MAX_TURNS = 6
MAX_TOKENS = 32


@dataclass
class Episode:
    """What one episode did: its reward, its turns, and the screenshots it sent, in order."""

    reward: float = 0.0
    turns: int = 0
    screenshots: list[np.ndarray] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


def data_url(pixels: np.ndarray) -> str:
    """A screenshot as a PNG data URL (lossless: the model sees the browser's pixels)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def to_openai(message: dict[str, Any], sent: list[np.ndarray]) -> dict[str, Any]:
    """An env message (text, or text and image parts holding arrays) as an OpenAI message,
    its images as image_url parts; the arrays sent are added to `sent`."""
    content = message["content"]
    if isinstance(content, str):
        return {"role": message["role"], "content": content}
    parts: list[dict[str, Any]] = []
    for part in content:
        if part["type"] == "image":
            sent.append(part["image"])
            parts.append({"type": "image_url", "image_url": {"url": data_url(part["image"])}})
        else:
            parts.append({"type": "text", "text": part["text"]})
    return {"role": message["role"], "content": parts}


def run_episode(client: openai.OpenAI, task: str, seed: int, *, max_turns: int = MAX_TURNS,
                temperature: float = 1.0) -> Episode:
    """One episode of `task` (page seed `seed`, held-out pages) with the model behind
    `client`."""
    env = MiniWoBEnv(task=task, observation="screenshot", split="eval", max_turns=max_turns)
    episode = Episode()
    try:
        first, _ = env.reset(seed=seed)
        history = [to_openai(m, episode.screenshots) for m in first]
        while True:
            reply = client.chat.completions.create(model="agentrl", messages=history,  # type: ignore[arg-type]
                                                   max_tokens=MAX_TOKENS,
                                                   temperature=temperature)
            answer = reply.choices[0].message.content or ""
            history.append({"role": "assistant", "content": answer})
            new, reward, terminated, truncated, info = env.step(answer)
            episode.turns += 1
            if terminated or truncated:
                episode.reward, episode.info = float(reward), info
                return episode
            history += [to_openai(m, episode.screenshots) for m in new]
    finally:
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True,
                        help="the session's base URL: http://HOST:PORT/sessions/<id>/v1")
    parser.add_argument("--task", default="click-button", help="a MiniWoB++ task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default="agentrl")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    episode = run_episode(client, args.task, args.seed)
    session = args.base_url.rstrip("/").removesuffix("/v1")
    with http_client(timeout_s=30) as http:
        http.post(f"{session}/reward", json={"reward": episode.reward}).raise_for_status()
    print(f"{args.task} seed {args.seed}: reward {episode.reward:.2f} in {episode.turns} turns, "
          f"{len(episode.screenshots)} screenshots sent ({episode.info.get('reason')})")


if __name__ == "__main__":
    main()
