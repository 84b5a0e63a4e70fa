"""Run many episodes of a `TokenEnv` concurrently against an `Engine` and return Trajectories.

Each episode is a coroutine: it awaits the engine for every turn (the engine batches all the
episodes' requests together) and runs its env calls (building the env, `reset`, `step`,
`close`) on a thread of its own, because env steps may block (code execution, graders).
Prompt i is reset with seed seeds[i]; its n samples share the group
`group_name(group_prefix, i)` so GRPO/RLOO baselines can be computed per group.

This loop is the one owner of the per-episode budgets (`EpisodeBudget`: turns and tokens) for
every env, bridged chat envs included: an episode that runs out ends truncated with
`info["truncated_by"]` = "max_turns" | "max_episode_tokens".

A trajectory holds what the policy conditioned on and sampled: an observation returned with
`terminated`/`truncated` (which no action follows) is not appended. An observation that comes
with `info["new_segment"]` (a chat template rewrote the earlier conversation) is a whole new
context: the episode goes on in a new segment, a trajectory of its own (`agentrl.segments`:
the segments share `info["episode"]` and the episode's final info, and follow each other in
the results); the token budget counts the current segment's context, what the model sees.
A `state_key` in the info of a `reset` or `step` names the state the next turn acts from
(`Turn.state_key`, GiGPO's anchor state: `agentrl.anchors`).

An episode whose env raises in `reset` or `step` ends there: the trajectory keeps the turns so
far, is marked truncated and carries `info["error"]`; the other episodes are unaffected. An env
that cannot be built (`env_fn` raises: a missing sandbox, a bad env argument) fails the
collection with its own error, since every episode would fail the same way. Engine failures
(other than a context overflow, which truncates the episode) propagate.

A hung env cannot stall the collection: with `env_timeout_s`, an episode whose env call runs
past it is abandoned there (`agentrl.rollout.env_calls`: what is and is not reclaimed), ends
truncated and discarded with `info["error"]` (an `EnvTimeoutError`, naming the call) and
`info["env_timeout"]` (the call: "env_fn", "reset", "step"), and its env is never called
again; the other episodes go on. A `close` past the deadline keeps its finished episode and
abandons only the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from agentrl.completion import SamplingParams
from agentrl.engine.affinity import conversation
from agentrl.engine.base import Engine, GenerationError, PromptTooLongError
from agentrl.rollout.budget import EpisodeBudget
from agentrl.rollout.env_calls import EnvThread, EnvTimeoutError
from agentrl.seeding import derive_seed
from agentrl.types import Image, Trajectory, TrajectoryBuilder, group_name

if TYPE_CHECKING:
    import gymnasium as gym

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Episode:
    prompt_index: int
    sample_index: int
    seed: int | None
    options: dict[str, Any] | None
    group: str


async def collect(
    engine: Engine,
    env_fn: Callable[[], gym.Env],
    *,
    num_prompts: int,
    n_samples_per_prompt: int = 1,
    sampling: SamplingParams,
    seeds: Sequence[int] | None = None,
    reset_options: Sequence[dict[str, Any] | None] | None = None,
    max_turns: int | None = None,
    max_episode_tokens: int | None = None,
    max_concurrency: int = 64,
    progress: bool = False,
    group_prefix: str = "",
    env_timeout_s: float | None = None,
) -> list[Trajectory]:
    """Run `num_prompts * n_samples_per_prompt` episodes; results ordered by (prompt, sample)
    (and segment, for an episode in several: module docstring).

    Args:
        engine: the policy.
        env_fn: returns a fresh env, e.g. `lambda: gym.make(env_id, tokenizer=tok)`.
        num_prompts: distinct prompts (env resets).
        n_samples_per_prompt: episodes per prompt, one group.
        sampling: per-turn sampling; `max_tokens` is the per-turn budget, `n` is ignored
            (each episode samples one completion per turn). A `seed` makes the whole
            collection reproducible (each episode and turn derives its own seed from it).
        seeds: reset seed of each prompt (default: its index).
        reset_options: reset options of each prompt.
        max_turns: budget of policy turns per episode; after the last one the episode ends
            truncated (the env's next observation is not appended).
        max_episode_tokens: budget on all tokens of an episode (prompt, actions, observations);
            when it runs out the episode ends truncated (an observation that leaves no room
            for an action is not appended).
        max_concurrency: most episodes in flight (each with its env thread).
        progress: show a progress bar (named by the group prefix, e.g. "eval").
        group_prefix: prefix of the group ids.
        env_timeout_s: longest one env call may take (None: no limit); an episode whose
            call runs past it is abandoned and discarded (module docstring).
    """
    episodes = _plan(num_prompts, n_samples_per_prompt, seeds, reset_options, group_prefix)
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    budget = EpisodeBudget(max_turns=max_turns, max_episode_tokens=max_episode_tokens,
                           env_timeout_s=env_timeout_s)
    bar = _progress_bar(len(episodes), group_prefix.rstrip("-") or "rollout") if progress else None
    sem = asyncio.Semaphore(max_concurrency)
    start, tokens = time.perf_counter(), 0

    async def run(ep: _Episode) -> list[Trajectory]:
        nonlocal tokens
        async with sem:
            segments = await _episode(engine, env_fn, ep, sampling, budget)
        if bar is not None:
            tokens += sum(t.num_policy_tokens for t in segments)
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - start, 1e-9):.0f}")
            bar.update(1)
        return segments

    try:
        done = await asyncio.gather(*(run(ep) for ep in episodes))
        return [t for segments in done for t in segments]
    finally:
        if bar is not None:
            bar.close()


def collect_sync(engine: Engine, env_fn: Callable[[], gym.Env], **kwargs: Any) -> list[Trajectory]:
    """`collect` for synchronous callers (same arguments).

    Runs its own event loop; when called from inside a running loop (a notebook), it runs in
    a helper thread instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(collect(engine, env_fn, **kwargs))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as ex:
        return ex.submit(asyncio.run, collect(engine, env_fn, **kwargs)).result()


def _plan(
    num_prompts: int,
    n: int,
    seeds: Sequence[int] | None,
    options: Sequence[dict[str, Any] | None] | None,
    prefix: str,
) -> list[_Episode]:
    if not isinstance(num_prompts, int) or num_prompts < 0:
        raise ValueError(f"num_prompts must be an integer >= 0, got {num_prompts!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n_samples_per_prompt must be an integer >= 1, got {n!r}")
    for name, seq in (("seeds", seeds), ("reset_options", options)):
        if seq is not None and len(seq) != num_prompts:
            raise ValueError(f"{name} has {len(seq)} entries but num_prompts is {num_prompts}")
    return [
        _Episode(
            prompt_index=i,
            sample_index=j,
            seed=int(seeds[i]) if seeds is not None else i,
            options=options[i] if options is not None else None,
            group=group_name(prefix, i),
        )
        for i in range(num_prompts)
        for j in range(n)
    ]


@dataclasses.dataclass
class _Outcome:
    """How an episode ended, filled in as it runs (so a failure keeps what came before)."""

    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


async def _episode(
    engine: Engine,
    env_fn: Callable[[], gym.Env],
    ep: _Episode,
    sampling: SamplingParams,
    budget: EpisodeBudget,
) -> list[Trajectory]:
    thread = EnvThread(f"agentrl-env-{ep.group}-{ep.sample_index}")
    timeout = budget.env_timeout_s
    builders = [TrajectoryBuilder(group=ep.group)]
    out = _Outcome()
    try:
        env: gym.Env = await thread.call("env_fn", env_fn, timeout=timeout)
    except EnvTimeoutError as e:
        _abandon(thread, None, ep, e, out)
        return _finish(builders, ep, out)
    except BaseException:  # cannot be built: not this episode's fault, raise
        thread.stop()
        raise
    hung = False
    try:
        await _play(engine, env, thread, ep, sampling, budget, builders, out)
    except EnvTimeoutError as e:
        hung = True
        _abandon(thread, env.close, ep, e, out)
    except Exception as e:  # an env failure ends this episode only, and it is not trained on
        if isinstance(e, GenerationError):
            raise
        out.truncated, out.info["error"], out.info["discard"] = True, repr(e), True
    finally:
        if not hung:
            await _close(thread, env, ep, timeout)
    return _finish(builders, ep, out)


async def _play(
    engine: Engine, env: gym.Env, thread: EnvThread, ep: _Episode, sampling: SamplingParams,
    budget: EpisodeBudget, builders: list[TrajectoryBuilder], out: _Outcome,
) -> None:
    """Reset and play the episode's turns, recording into `builders` (one per segment, the
    current last) and `out`."""
    timeout = budget.env_timeout_s
    builder = builders[-1]
    obs, info = await thread.call("reset", env.reset, seed=ep.seed, options=ep.options,
                                  timeout=timeout)
    out.info = dict(info)
    state_key = info.get("state_key")  # GiGPO's anchor state, when the env names it
    context, images = _observe(builder, obs, [], [], engine)
    turn = 0
    while True:
        over = budget.exhausted(turns=turn, tokens=len(context))
        if over is not None:  # the prompt alone leaves no room
            out.truncated, out.info["truncated_by"] = True, over
            return
        params = dataclasses.replace(
            sampling, n=1, max_tokens=budget.sample_limit(len(context), sampling.max_tokens),
            seed=_turn_seed(sampling.seed, ep, turn),
        )
        try:
            with conversation(ep.group):  # a router keeps a group on one engine
                [c] = await engine.generate(context, params, images or None)
        except PromptTooLongError:
            out.truncated, out.info["truncated_by"] = True, "max_context"
            return
        step = builder.add_action(
            c.token_ids,
            c.logprobs,
            policy_version=c.policy_version,
            finish_reason=c.finish_reason,
            version_changes=c.version_changes,
        )
        step.state_key = None if state_key is None else str(state_key)
        context.extend(c.token_ids)
        turn += 1
        if c.finish_reason == "abort":
            out.truncated, out.info["truncated_by"] = True, "abort"
            return
        obs, reward, terminated, truncated, step_info = await thread.call(
            "step", env.step, np.asarray(c.token_ids, dtype=np.int64), timeout=timeout
        )
        step.reward = float(reward)
        out.terminated, out.truncated, out.info = bool(terminated), bool(truncated), dict(step_info)
        state_key = step_info.get("state_key")
        if terminated or truncated:
            return
        fresh = bool(step_info.get("new_segment"))  # a whole new context: a new segment
        over = budget.exhausted(turns=turn,
                                tokens=(0 if fresh else len(context)) + len(obs["tokens"]))
        if over is not None:
            # No turn left, or no room to act after this observation: end without it.
            out.truncated, out.info["truncated_by"] = True, over
            return
        if fresh:
            builder = TrajectoryBuilder(group=ep.group)
            builders.append(builder)
            context, images = [], []
        context, images = _observe(builder, obs, context, images, engine)


def _abandon(thread: EnvThread, cleanup: Callable[[], Any] | None, ep: _Episode,
             error: EnvTimeoutError, out: _Outcome) -> None:
    """End an episode whose env call hung: discard it with the reason and give its thread up
    (it closes the env if the call ever returns)."""
    out.truncated = True
    out.info.update(error=repr(error), discard=True, env_timeout=error.call)
    still = thread.abandon(cleanup)
    logger.warning("episode %s (prompt %d, sample %d) discarded: %s; %d abandoned env thread%s "
                   "still running", ep.group, ep.prompt_index, ep.sample_index, error, still,
                   "" if still == 1 else "s")


async def _close(thread: EnvThread, env: gym.Env, ep: _Episode, timeout: float | None) -> None:
    """Close a finished episode's env; one whose close hangs keeps its episode and gives its
    thread up."""
    try:
        await thread.call("close", env.close, timeout=timeout)
    except EnvTimeoutError as e:
        still = thread.abandon()
        logger.warning("episode %s (prompt %d, sample %d): %s; %d abandoned env thread%s still "
                       "running", ep.group, ep.prompt_index, ep.sample_index, e, still,
                       "" if still == 1 else "s")
        return
    except BaseException:
        thread.stop()
        raise
    thread.stop()


def _finish(builders: list[TrajectoryBuilder], ep: _Episode, out: _Outcome) -> list[Trajectory]:
    """The episode's trajectory, or its segments' (each with the episode's outcome and info)."""
    out.info.update(prompt_index=ep.prompt_index, sample_index=ep.sample_index, seed=ep.seed)
    out.info.pop("new_segment", None)
    discard = bool(out.info.get("discard", False))
    if len(builders) == 1:
        return [builders[0].build(terminated=out.terminated, truncated=out.truncated,
                                  info=out.info, discard=discard)]
    episode = uuid.uuid4().hex
    return [b.build(terminated=out.terminated, truncated=out.truncated, discard=discard,
                    info={**out.info, "episode": episode, "segment": k,
                          "segment_cause": "template" if k else "start"})
            for k, b in enumerate(builders)]


def _observe(
    builder: TrajectoryBuilder, obs: dict[str, Any], context: list[int],
    images: list[np.ndarray], engine: Engine,
) -> tuple[list[int], list[np.ndarray]]:
    """Append an observation; its images are placed where their tokens sit (the model's
    processor tells which tokens are whose)."""
    tokens, new_images, placed = placed_images(
        obs, len(context), lambda: getattr(engine, "vision", None) or _vision(engine))
    builder.add_observation(tokens, placed)
    return context + tokens, images + new_images


def _vision(engine: Engine) -> Any:
    from agentrl.models.vision import vision_processor

    return vision_processor(getattr(engine, "tokenizer", None))


def placed_images(
    obs: dict[str, Any], offset: int, vision_of: Callable[[], Any]
) -> tuple[list[int], list[np.ndarray], list[Image]]:
    """An observation's tokens, its images, and the images placed at their tokens' positions
    in a trajectory where the observation starts at `offset`; `vision_of()` gives the model's
    image processor (None for a text-only model, an error if the observation has images)."""
    tokens = [int(t) for t in np.asarray(obs["tokens"]).reshape(-1)]
    new_images = [np.asarray(im, dtype=np.uint8) for im in obs.get("images", ())]
    if not new_images:
        return tokens, [], []
    from agentrl.models.vision import ImageError

    vision = vision_of()
    if vision is None:
        raise ImageError("the environment sent images but the policy is a text-only model")
    return tokens, new_images, [
        Image(pixels=im, start=offset + a, end=offset + b)
        for im, (a, b) in zip(new_images, vision.spans(tokens, new_images), strict=True)
    ]


def _turn_seed(seed: int | None, ep: _Episode, turn: int) -> int | None:
    # Distinct per episode and turn, so the samples of a group differ but reruns repeat.
    if seed is None:
        return None
    return derive_seed(seed, ep.prompt_index, ep.sample_index, turn)


def _progress_bar(total: int, desc: str) -> Any:
    if _in_ray_worker():
        return _DriverDrawnBar(total, desc)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="ep", dynamic_ncols=True)


def _in_ray_worker() -> bool:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    return bool(ray._private.worker.global_worker.mode == ray.WORKER_MODE)


class _DriverDrawnBar:
    """A progress bar in a Ray worker, drawn by the driver (Ray's tqdm_ray): a plain tqdm
    there reaches the terminal through the worker's log, one prefixed line per refresh."""

    def __init__(self, total: int, desc: str) -> None:
        from ray.experimental.tqdm_ray import tqdm

        self._desc = desc
        self._bar = tqdm(total=total, desc=desc, unit="ep")

    def set_postfix(self, **values: object) -> None:
        shown = ", ".join(f"{k}={v}" for k, v in values.items())
        self._bar.set_description(f"{self._desc} {shown}")

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()
