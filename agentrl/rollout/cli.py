"""`agentrl rollout`: sample trajectories from an environment and write them as JSON lines.

    agentrl rollout --env reverse --model tiny -n 4 --prompts 8 --out rollouts.jsonl

Every trajectory is token-exact (ids, loss mask, sampler logprobs, per-turn rewards), so the
file can be inspected, replayed or trained on (`agentrl.trajectory_files.load_jsonl`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from agentrl.command_line import (
    EpisodeOptions,
    check_positive,
    parse_flags,
    validation_deferred,
)
from agentrl.models import DEFAULT_MODEL
from agentrl.models.named import check_engine_loads

RENAMED = {"--max_tokens": "--max_new_tokens"}
"""Flags renamed to the spelling train, eval and rollout share (the old one works until the next
release)."""


@dataclass(frozen=True, kw_only=True)
class RolloutArgs(EpisodeOptions):
    """Sample trajectories from an environment and write them as JSON lines."""

    env: str
    """Environment id or alias (`agentrl envs` lists them), e.g. agentrl/Reverse-v0 or reverse."""
    model: str = DEFAULT_MODEL
    """Model name (smollm2-135m-instruct, tiny) or a local Hugging Face model directory."""
    samples: Annotated[int, tyro.conf.arg(aliases=("-n",))] = 4
    """Episodes per prompt (one group, for group baselines)."""
    prompts: int = 8
    """Distinct prompts (env resets with seeds seed, seed+1, ...)."""
    seed: int = 0
    """First reset seed; also seeds sampling, so a rerun gives the same file."""
    out: Path = Path("rollouts.jsonl")
    """Where to write the trajectories (their images, e.g. screenshots, as PNG files in
    images/ beside it)."""
    env_kwargs: str = "{}"
    """The env's constructor arguments as JSON, e.g. MiniWoB-v0's '{"observation":
    "screenshot"}' (`help(gym.spec(ID).kwargs["target"])` lists them)."""
    task: str | None = None
    """The env's `task` argument, for envs that take one: MiniWoB-v0's --task
    click-button,enter-text (a task, a suite or a comma list)."""

    def __post_init__(self) -> None:
        if not validation_deferred():
            EpisodeOptions.__post_init__(self)
            check_positive(self, "samples", "prompts")
            check_engine_loads(self.engine, self.model, engine_flag="--engine",
                               model_flag="--model")


def main(argv: list[str]) -> int:
    try:
        args = parse_flags(RolloutArgs, argv, prog="agentrl rollout", doc=__doc__,
                           renamed=RENAMED)
    except ValueError as e:
        print(f"agentrl rollout: {e}", file=sys.stderr)
        return 2
    return run(args)


def run(args: RolloutArgs) -> int:
    import gymnasium as gym

    import agentrl  # noqa: F401 - registers the built-in env ids
    from agentrl.envs import resolve_env_id
    from agentrl.models import load_tokenizer
    from agentrl.rollout import collect_sync
    from agentrl.rollout.evaluate import env_arguments, preflight_env
    from agentrl.trajectory_files import image_dir_of, save_jsonl

    try:
        env_id = resolve_env_id(args.env)
        kwargs = env_arguments(env_id, args.env_kwargs, task=args.task, max_turns=args.max_turns)
        preflight_env(args.env, env_id, kwargs)
        sampling = args.sampling()
        tokenizer = load_tokenizer(args.model)
        engine = args.open_engine(args.model, tokenizer)
    except ValueError as e:
        print(f"agentrl rollout: {e}", file=sys.stderr)
        return 2
    with contextlib.closing(engine):
        start = time.perf_counter()
        trajs = collect_sync(
            engine,
            lambda: gym.make(env_id, tokenizer=tokenizer, **kwargs),
            num_prompts=args.prompts,
            n_samples_per_prompt=args.samples,
            sampling=sampling,
            seeds=[args.seed + i for i in range(args.prompts)],
            max_turns=args.max_turns,
            max_episode_tokens=args.max_episode_tokens,
            max_concurrency=max(args.max_batch_size, 1),
            progress=args.progress,
        )
    elapsed = time.perf_counter() - start
    n = save_jsonl(trajs, args.out)
    images = sum(len(t.images) for t in trajs)
    tokens = sum(t.num_policy_tokens for t in trajs)
    errors = sum("error" in t.info for t in trajs)
    mean_reward = sum(t.total_reward for t in trajs) / max(len(trajs), 1)
    print(
        f"{n} episodes ({args.prompts} prompts x {args.samples}) of {env_id} with {args.model}: "
        f"mean reward {mean_reward:.3f}, {tokens} sampled tokens in {elapsed:.1f}s "
        f"({tokens / max(elapsed, 1e-9):.1f} tok/s)" + (f", {errors} env errors" if errors else "")
    )
    print(f"wrote {args.out}" + (f" and its {images} images (in {image_dir_of(args.out)})"
                                 if images else ""))
    return 0
