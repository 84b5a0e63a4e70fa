"""A black-box agent for the proxy-training test: plain `openai` client, one chat call."""

from __future__ import annotations


async def digits_agent(task: dict, base_url: str, api_key: str) -> str:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    out = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=8,
        temperature=1.0,
    )
    return out.choices[0].message.content or ""


def digits_reward(task: dict, result: str) -> float:
    text = result.strip()
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0
