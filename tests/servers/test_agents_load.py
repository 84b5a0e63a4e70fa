"""The agent runner and many concurrent streaming sessions."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from agentrl.engine.fakes import FakeEngine, StreamingFakeEngine
from servers.agents import run_agents
from servers.app import create_app


async def _async_agent(task: str, base_url: str, api_key: str) -> str:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    msgs = [{"role": "user", "content": task}]
    for _ in range(2):
        r = await client.chat.completions.create(model="agentrl", messages=msgs)
        msgs += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "more"},
        ]
    await client.close()
    return r.choices[0].message.content


def _sync_agent(task: str, base_url: str, api_key: str) -> str:
    if task == "boom":
        raise RuntimeError("agent crashed")
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return (
        client.chat.completions.create(
            model="agentrl", messages=[{"role": "user", "content": task}]
        )
        .choices[0]
        .message.content
    )


def test_run_agents_async_agent_with_rewards(tok):
    app = create_app(FakeEngine(tok), tok)
    trajs = asyncio.run(
        run_agents(
            _async_agent,
            ["a", "b", "a"],
            app=app,
            concurrency=2,
            reward_fn=lambda task, out: 1.0 if "42" in out else 0.0,
            group_fn=lambda i, task: task,
        )
    )
    assert len(trajs) == 3
    assert all(len(t.turns) == 2 and t.rewards == [0.0, 1.0] and t.terminated for t in trajs)
    assert [t.group for t in trajs] == ["a", "b", "a"]
    assert [t.info["task_index"] for t in trajs] == [0, 1, 2]


def test_run_agents_sync_agent_keeps_failed_episode_discarded(make_proxy):
    p = make_proxy()
    trajs = asyncio.run(run_agents(_sync_agent, ["x", "boom", "y"], base_url=f"{p.url}/v1"))
    assert [t.info["task_index"] for t in trajs] == [0, 1, 2]
    # The failed agent recorded nothing: its episode is an empty placeholder, discarded with
    # the reason, counted in the step (#32 item 6).
    assert [t.discard for t in trajs] == [False, True, False] and trajs[1].token_ids == []
    assert trajs[1].info["error"] == "RuntimeError: agent crashed"
    assert p.store.list() == []  # collected sessions are deleted from the proxy


def test_run_agents_needs_one_target(tok):
    with pytest.raises(ValueError, match="exactly one of base_url"):
        asyncio.run(run_agents(_sync_agent, ["x"]))


async def _stream_session(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
    body = {
        "model": "agentrl",
        "stream": True,
        "messages": [{"role": "user", "content": f"session {i}"}],
    }
    text = ""
    async with client.stream("POST", f"/sessions/s{i}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    return i, text


@pytest.mark.slow
def test_256_concurrent_streaming_sessions_never_mix(make_proxy, tok):
    def reply(prompt: str, _choice: int) -> str:
        match = re.search(r"session (\d+)", prompt)
        assert match is not None
        return "reply to " + match.group(1)

    engine = StreamingFakeEngine(tok, reply=reply, latency_s=0.02, token_latency_s=0.002)
    p = make_proxy(engine)

    async def main():
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(base_url=p.url, timeout=60, limits=limits) as c:
            return await asyncio.gather(*(_stream_session(c, i) for i in range(256)))

    results = asyncio.run(main())
    for i, text in results:
        assert text == f"reply to {i}", (i, text)
        (traj,) = p.store.get(f"s{i}").trajectories()
        action = tok.decode(traj.token_ids[traj.turns[0].start : traj.turns[0].end])
        assert action == f"reply to {i}<|im_end|>"
