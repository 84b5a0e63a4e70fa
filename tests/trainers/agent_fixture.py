"""Black-box agents for the proxy-training tests: the real `openai` client, one per episode."""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import openai

_TLS = ssl.create_default_context()


def _client(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    """The episode's own client, on one shared TLS context: a client builds its own otherwise,
    reading the CA bundle (~20 ms, on the event loop), which a client per episode paid hundreds
    of times a run (~40% of the proxy-training test's time), though the proxy is plain http."""
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                              http_client=openai.DefaultAsyncHttpxClient(verify=_TLS))


async def digits_agent(task: dict, base_url: str, api_key: str) -> str:
    async with _client(base_url, api_key) as client:
        out = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=8,
            temperature=1.0,
        )
    return out.choices[0].message.content or ""


def digits_reward(task: dict, result: str) -> float:
    text = result.strip()
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def _data_url(seed: int) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def screen_agent(task: dict, base_url: str, api_key: str) -> str:
    """Two chat calls, each sending a new screenshot as an image_url data URL, the second
    continuing the first conversation (one session, one trajectory)."""
    messages: list = []
    answer = ""
    async with _client(base_url, api_key) as client:
        for turn in range(2):
            messages.append({"role": "user", "content": [
                {"type": "text", "text": f"Screen {turn}: where is the red square?"},
                {"type": "image_url", "image_url": {"url": _data_url(task["seed"] * 2 + turn)}},
            ]})
            out = await client.chat.completions.create(
                model="agentrl", messages=messages, max_tokens=6, temperature=1.0,
            )
            answer = out.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": answer})
    return answer


async def uncapped_agent(task: dict, base_url: str, api_key: str) -> str:
    """One chat call that sets no max_tokens (as the Agents SDK's default model settings)."""
    async with _client(base_url, api_key) as client:
        out = await client.chat.completions.create(
            model="agentrl", messages=[{"role": "user", "content": task["prompt"]}])
    return out.choices[0].message.content or ""


async def flaky_agent(task: dict, base_url: str, api_key: str) -> str:
    """digits_agent, but a task with "fail" raises after its call (a tool that broke)."""
    answer = await digits_agent(task, base_url, api_key)
    if task.get("fail"):
        raise RuntimeError("the agent's tool broke")
    return answer
