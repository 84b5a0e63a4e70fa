"""Run black-box agents against the proxy and collect their Trajectories (one session each).

This is how a trainer uses an agent written for any OpenAI-compatible framework: the agent
only sees a `base_url` and an `api_key`; everything it makes the model generate is recorded
token-exact by the proxy.

    async def agent(task, base_url, api_key):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        ...
        return answer

    trajectories = await run_agents(agent, tasks, app=app, reward_fn=score)

An agent that raises, fails (`AgentFailed`: a command agent's non-zero exit) or sends no request
for `timeout_s` is ended (cancelled; a command agent's process group killed): its recorded turns
are kept, marked discarded with the reason, and the other episodes go on (#32 item 6). Every
trajectory's `info["agent"]` says how its agent ended (`status`: finished, failed or timed_out;
`cause` of a failure; `tokens`: what its session sampled).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI

from agentrl.http_client import async_http_client
from agentrl.rewards import RewardServiceError
from agentrl.seeding import derive_seed
from agentrl.terminal_safe import visible
from agentrl.types import Trajectory, group_name
from servers.serving import serve_in_thread

log = logging.getLogger(__name__)

TaskT = TypeVar("TaskT")
T = TypeVar("T")
AgentFn = Callable[[TaskT, str, str], object | Awaitable[object]]
"""(task, base_url, api_key) -> result; sync (run in a thread) or async."""
RewardFn = Callable[[TaskT, object], float | Awaitable[float]]
"""(task, agent result) -> reward for the episode."""


@dataclass(frozen=True)
class AgentAnswer:
    """An agent's result with more to keep with its session (a command agent's exit status and
    stderr tail): the reward scores `answer`; `info` joins the trajectories' info."""

    answer: object
    info: dict[str, object] = field(default_factory=dict)


class AgentFailed(Exception):
    """An agent that ended without an answer. `cause`: a short name ("exit", "start",
    "timeout", ...), counted per step; `info`: what to keep with its session."""

    def __init__(self, cause: str, message: str, info: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.info = dict(info or {})


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


async def _call(agent_fn: AgentFn, task: Any, url: str, api_key: str) -> object:
    if inspect.iscoroutinefunction(agent_fn) or inspect.iscoroutinefunction(
        type(agent_fn).__call__  # an agent object with an async __call__ (CommandAgent)
    ):
        return await agent_fn(task, url, api_key)  # type: ignore[misc]
    # A sync agent runs in a thread: on a timeout it is abandoned (Python cannot end a thread),
    # and its later calls reach a deleted session.
    return await _maybe_await(await asyncio.to_thread(agent_fn, task, url, api_key))


async def _watched(run: Awaitable[T], http: Any, sid: str, timeout_s: float | None) -> T:
    """`run`'s result; AgentFailed("timeout") once its session has seen no request (none in
    flight, none new) for `timeout_s`. An unfinished run is cancelled before this returns."""
    job = asyncio.ensure_future(run)
    if timeout_s is None:
        return await job
    loop = asyncio.get_running_loop()
    seen: tuple | None = None
    idle_since = loop.time()
    try:
        while True:
            done, _ = await asyncio.wait({job}, timeout=min(0.5, timeout_s / 4))
            if done:
                return job.result()
            body = (await http.get(f"/sessions/{sid}")).json()
            mark = (body.get("num_calls"), body.get("aborted_calls"), body.get("replaced_calls"))
            if body.get("in_flight") or mark != seen:
                seen, idle_since = mark, loop.time()
            elif loop.time() - idle_since >= timeout_s:
                raise AgentFailed("timeout", f"the agent sent no request for {timeout_s:g} s "
                                             f"(--agent_timeout_s); it was ended")
    finally:
        if not job.done():
            job.cancel()
            with contextlib.suppress(BaseException):
                await job  # a command agent kills its process group here


@contextlib.asynccontextmanager
async def _server(base_url: str | None, app: FastAPI | None) -> AsyncIterator[str]:
    if base_url is not None and app is None:
        yield base_url.rstrip("/").removesuffix("/v1")
    elif app is not None and base_url is None:
        with serve_in_thread(app) as url:
            yield url
    else:
        raise ValueError("run_agents needs exactly one of base_url= (a running proxy) or app=")


@dataclass
class _Episodes:
    """What every episode of one `run_agents` call shares."""

    http: Any
    root: str
    api_key: str
    agent_fn: AgentFn
    reward_fn: RewardFn | None
    timeout_s: float | None
    raise_on_error: bool

    async def run(self, sid: str, i: int, task: Any) -> tuple[dict[str, Any], str | None]:
        """Run the agent in session `sid`, score it; (its info["agent"] and what joins the
        trajectories' info, the reason they are discarded or None)."""
        extra: dict[str, Any] = {}
        try:
            result = await _watched(_call(self.agent_fn, task, f"{self.root}/sessions/{sid}/v1",
                                          self.api_key), self.http, sid, self.timeout_s)
        except Exception as e:
            if self.raise_on_error:
                raise
            cause = e.cause if isinstance(e, AgentFailed) else "raised"
            extra = e.info if isinstance(e, AgentFailed) else {}
            error = str(e) if isinstance(e, AgentFailed) else f"{type(e).__name__}: {e}"
            log.warning("agent failed on task %d (%s); its episode is discarded: %s", i, cause,
                        visible(error))  # an agent's error may carry its stderr's escapes
            status = "timed_out" if cause == "timeout" else "failed"
            return {"status": status, "cause": cause, **extra}, error
        if isinstance(result, AgentAnswer):
            extra = dict(result.info)
            result = result.answer
        if not (await self.http.get(f"/sessions/{sid}")).json()["num_calls"]:
            return {"status": "failed", "cause": "no_calls", **extra}, (
                "the agent made no model call")
        if self.reward_fn is not None:
            try:
                reward = float(await _maybe_await(self.reward_fn(task, result)))
            except RewardServiceError as e:
                return {"status": "finished", **extra}, str(e)  # the service failed: kept
            r = await self.http.post(f"/sessions/{sid}/reward", json={"reward": reward})
            r.raise_for_status()
        return {"status": "finished", **extra}, None

    async def collect(self, sid: str, group: str, info: dict[str, Any],
                      ended: dict[str, Any], error: str | None) -> list[Trajectory]:
        """The session's trajectories (one empty placeholder when it recorded nothing), marked
        with how the agent ended; the session is deleted from the proxy."""
        await self.http.post(f"/sessions/{sid}/close")
        body = (await self.http.get(f"/sessions/{sid}")).json()
        await self.http.delete(f"/sessions/{sid}")
        trajs = [Trajectory.from_dict(t) for t in body["trajectories"]] or [Trajectory(
            token_ids=[], loss_mask=[], logprobs=[], turns=[], group=group, uid=f"{sid}-0",
            info={**info, "session_id": sid, "episode": sid, "segment": 0,
                  "segment_cause": "start", "drift": False})]
        status = {k: v for k, v in ended.items() if k in ("status", "cause")}
        status["tokens"] = sum(t.num_policy_tokens for t in trajs)
        for t in trajs:
            t.info.update({k: v for k, v in ended.items() if k not in ("status", "cause")})
            t.info["agent"] = status
            if error is not None:  # kept and counted as discarded, never trained on
                t.discard, t.info["error"] = True, error
        return trajs


def _report_failed_groups(results: list[list[Trajectory]]) -> None:
    groups: dict[str | None, list[Trajectory]] = {}
    for trajs in results:
        groups.setdefault(trajs[0].group if trajs else None, []).extend(trajs)
    for group, trajs in groups.items():
        if trajs and all(t.discard for t in trajs):
            causes = sorted({str(t.info.get("agent", {}).get("cause", "reward")) for t in trajs})
            log.warning("every episode of group %s was discarded (%s): %s", group,
                        ", ".join(causes), visible(str(trajs[0].info.get("error", ""))[:300]))


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
    timeout_s: float | None = None,
    seed: int | None = None,
) -> list[Trajectory]:
    """Run `agent_fn` `n_samples_per_task` times per task, each run in its own proxy session;
    return all trajectories.

    base_url: a running proxy (`http://127.0.0.1:8000`); or app: a proxy app to serve on a
    loopback port for the duration. The runs of task i are one group, named when its
    sessions are created: `group_name(group_prefix, i)` (as env rollouts name prompt i's), or
    group_fn(i, task), so they share a GRPO/RLOO baseline. An agent that raises (or is
    re-raised with raise_on_error=True), fails, makes no model call or sends no request for
    `timeout_s` keeps its recorded turns marked `discard`, with the reason in `info["error"]`
    (an empty placeholder trajectory when it recorded none); so does an episode a reward service
    cannot score (`RewardServiceError`). A group whose episodes are all discarded is logged.
    Trajectories come back in (task, sample) order; a session in segments (a chat template
    that rewrites history, or a client that changed text) yields one per segment, all of one
    episode (`agentrl.segments`). seed: the session of task i's sample j is seeded with
    derive_seed(seed, i, j), so the calls that set no seed sample the same tokens on every run
    (`servers.sessions.Session.call_seed`); None leaves them to the engine's shared generator.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if n_samples_per_task < 1:
        raise ValueError(f"n_samples_per_task must be >= 1, got {n_samples_per_task}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 (or None: no limit), got {timeout_s}")
    sem = asyncio.Semaphore(concurrency)
    async with _server(base_url, app) as root, async_http_client(
        timeout_s=None, retries=2, base_url=root, headers={"authorization": f"Bearer {api_key}"}
    ) as http:
        episodes = _Episodes(http, root, api_key, agent_fn, reward_fn, timeout_s, raise_on_error)

        async def episode(i: int, j: int, task: TaskT) -> list[Trajectory]:
            async with sem:
                group = group_fn(i, task) if group_fn else group_name(group_prefix, i)
                name = f"ep{i}" if n_samples_per_task == 1 else f"ep{i}.{j}"  # task.sample
                sid = f"{name}-{uuid.uuid4().hex[:12]}"
                info = {"task_index": i, "sample_index": j}
                body: dict[str, Any] = {"id": sid, "group": group, "info": info}
                if seed is not None:
                    body["seed"] = derive_seed(seed, i, j)
                r = await http.post("/sessions", json=body)
                r.raise_for_status()
                try:
                    ended, error = await episodes.run(sid, i, task)
                except BaseException:
                    await http.delete(f"/sessions/{sid}")
                    raise
                return await episodes.collect(sid, group, info, ended, error)

        results = await asyncio.gather(
            *(episode(i, j, t) for i, t in enumerate(tasks) for j in range(n_samples_per_task))
        )
    _report_failed_groups(results)
    return [traj for episode_trajs in results for traj in episode_trajs]
