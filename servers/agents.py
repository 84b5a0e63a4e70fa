"""Run black-box agents against the proxy and collect their Trajectories (one session each).

This is how a trainer uses an agent written for any OpenAI-compatible framework: the agent
only sees a `base_url` and an `api_key`; everything it makes the model generate is recorded
token-exact by the proxy.

    async def agent(task, base_url, api_key):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        ...
        return answer

    trajectories = await run_agents(agent, tasks, app=app, reward_fn=score)
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI

from agentrl.http_client import async_http_client
from agentrl.rewards import RewardServiceError
from agentrl.types import Trajectory, group_name
from servers.serving import serve_in_thread

log = logging.getLogger(__name__)

TaskT = TypeVar("TaskT")
T = TypeVar("T")
AgentFn = Callable[[TaskT, str, str], object | Awaitable[object]]
"""(task, base_url, api_key) -> result; sync (run in a thread) or async."""
RewardFn = Callable[[TaskT, object], float | Awaitable[float]]
"""(task, agent result) -> reward for the episode."""


def remote_agent_reward(url: str, **options: Any) -> RewardFn:
    """Score agent episodes with a reward service (`agentrl reward-serve`, `--reward.url`): each
    is one item {"prompt": task, "response": the agent's result (JSON unless a string),
    "label": task["label"] if the task has one}, batched with concurrent episodes. A failure
    raises `RewardServiceError`, which `run_agents` turns into a discarded, counted episode.
    `options`: `RemoteReward`'s (timeout_s, retries, max_batch)."""
    from agentrl.rewards import RemoteReward

    service = RemoteReward(url, **options)

    def score(task: Any, result: object) -> float:
        label = task.get("label") if isinstance(task, dict) else None
        response = result if isinstance(result, str) else json.dumps(result, default=str)
        return float(service(task, response, label)["reward"])

    return score


async def _maybe_await(value: T | Awaitable[T]) -> T:
    return await value if inspect.isawaitable(value) else value


@contextlib.asynccontextmanager
async def _server(base_url: str | None, app: FastAPI | None) -> AsyncIterator[str]:
    if base_url is not None and app is None:
        yield base_url.rstrip("/").removesuffix("/v1")
    elif app is not None and base_url is None:
        with serve_in_thread(app) as url:
            yield url
    else:
        raise ValueError("run_agents needs exactly one of base_url= (a running proxy) or app=")


async def run_agents(
    agent_fn: AgentFn,
    tasks: Sequence[TaskT],
    *,
    base_url: str | None = None,
    app: FastAPI | None = None,
    reward_fn: RewardFn | None = None,
    concurrency: int = 16,
    api_key: str = "agentrl",
    n_samples_per_task: int = 1,
    group_prefix: str = "",
    group_fn: Callable[[int, TaskT], str] | None = None,
    raise_on_error: bool = False,
) -> list[Trajectory]:
    """Run `agent_fn` `n_samples_per_task` times per task, each run in its own proxy session;
    return all trajectories.

    base_url: a running proxy (`http://127.0.0.1:8000`); or app: a proxy app to serve on a
    loopback port for the duration. The runs of task i are one group, named when its
    sessions are created: `group_name(group_prefix, i)` (as env rollouts name prompt i's), or
    group_fn(i, task), so they share a GRPO/RLOO baseline. An agent that raises is logged and
    its episode dropped (or re-raised with raise_on_error=True); a reward service that cannot
    score an episode (`RewardServiceError`, e.g. `remote_agent_reward`'s) leaves its
    trajectories marked `discard`, with the error in `info["error"]`. Trajectories come back in
    (task, sample) order; a session with drift yields several (one per segment).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if n_samples_per_task < 1:
        raise ValueError(f"n_samples_per_task must be >= 1, got {n_samples_per_task}")
    sem = asyncio.Semaphore(concurrency)
    async with _server(base_url, app) as root, async_http_client(
        timeout_s=None, retries=2, base_url=root, headers={"authorization": f"Bearer {api_key}"}
    ) as http:

        async def episode(i: int, j: int, task: TaskT) -> list[Trajectory]:
            async with sem:
                group = group_fn(i, task) if group_fn else group_name(group_prefix, i)
                name = f"ep{i}" if n_samples_per_task == 1 else f"ep{i}.{j}"  # task.sample
                sid = f"{name}-{uuid.uuid4().hex[:12]}"
                r = await http.post("/sessions", json={
                    "id": sid, "group": group, "info": {"task_index": i, "sample_index": j}})
                r.raise_for_status()
                session_url = f"{root}/sessions/{sid}/v1"
                try:
                    if inspect.iscoroutinefunction(agent_fn):
                        result = await agent_fn(task, session_url, api_key)
                    else:
                        result = await _maybe_await(
                            await asyncio.to_thread(agent_fn, task, session_url, api_key)
                        )
                    unscored = None
                    if reward_fn is not None and (await http.get(f"/sessions/{sid}")).json()[
                        "num_calls"
                    ]:
                        try:
                            reward = float(await _maybe_await(reward_fn(task, result)))
                        except RewardServiceError as e:
                            unscored = str(e)  # the service failed, not the agent: keep it
                        else:
                            r = await http.post(f"/sessions/{sid}/reward",
                                                json={"reward": reward})
                            r.raise_for_status()
                except Exception:
                    if raise_on_error:
                        raise
                    log.exception("agent failed on task %d; its episode is dropped", i)
                    await http.delete(f"/sessions/{sid}")
                    return []
                await http.post(f"/sessions/{sid}/close")
                body = (await http.get(f"/sessions/{sid}")).json()
                await http.delete(f"/sessions/{sid}")
                trajs = [Trajectory.from_dict(t) for t in body["trajectories"]]
                if unscored is not None:  # kept and counted as discarded, never trained on
                    for t in trajs:
                        t.discard, t.info["error"] = True, unscored
                return trajs

        results = await asyncio.gather(
            *(episode(i, j, t) for i, t in enumerate(tasks) for j in range(n_samples_per_task))
        )
    return [traj for episode_trajs in results for traj in episode_trajs]
