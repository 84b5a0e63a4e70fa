"""Named presets: Python functions returning a TrainConfig. `agentrl train --env X` starts from
the preset registered for X (if any), then applies --config and flags on top."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from trainers.config import ActorConfig, AlgoConfig, RolloutConfig, TrainConfig


def math_tir() -> TrainConfig:
    """The headline run: GRPO on tool-integrated arithmetic with the embedded SmolLM2-135M,
    trained on a mix of easy and medium problems and evaluated on held-out medium ones, which
    the base model cannot solve (pass@1 ~0): the easy half teaches the tool protocol, which
    then carries over to the medium half. Sized to finish within 15 minutes on a 2-core CPU
    (benchmarks/results/math_tir_medium.md has the runs and the levers measured)."""
    return TrainConfig(
        env="math-tir",
        env_kwargs={"split": "train", "tasks": "basic_arithmetic", "difficulty": "easy,medium"},
        eval_env_kwargs={"split": "eval", "difficulty": "medium"},
        actor=ActorConfig(lr=1e-5),
        algo=AlgoConfig(estimator="group_norm"),
        rollout=RolloutConfig(
            n_samples_per_prompt=4, prompts_per_step=4, max_new_tokens=64, max_turns=2,
            max_episode_tokens=512,
        ),
        steps=25,
        micro_batch_size=8,
        eval_problems=64,
        eval_samples=1,
        eval_temperature=1.0,
        run_dir="runs/math-tir",
    )


def math_tir_easy() -> TrainConfig:
    """The earlier default: easy problems only, trained and evaluated (12 steps, ~5 minutes on
    2 cores). It mostly teaches the tool protocol: greedy decoding of the base model already
    solves ~0.9 of these."""
    return dataclasses.replace(
        math_tir(),
        env_kwargs={"split": "train", "tasks": "basic_arithmetic", "difficulty": "easy"},
        eval_env_kwargs={"split": "eval"},
        steps=12,
        eval_problems=32,
        eval_samples=2,
        run_dir="runs/math-tir-easy",
    )


def screen_click() -> TrainConfig:
    """A vision-language agent on screenshots: GRPO on ScreenClick with `embedded-vlm` (built
    and warmed up on first use), sized for a 2-core CPU. The evaluation before training is the
    warm-up alone; the one after is warm-up + RL (64 held-out episodes, sampled at T=1)."""
    return TrainConfig(
        env="screen-click",
        env_kwargs={"split": "train"},
        eval_env_kwargs={"split": "eval"},
        actor=ActorConfig(model="embedded-vlm", lr=2e-5),
        algo=AlgoConfig(estimator="group_norm"),
        rollout=RolloutConfig(
            n_samples_per_prompt=4, prompts_per_step=8, max_new_tokens=12, max_turns=3,
            max_episode_tokens=512,
        ),
        steps=8,
        micro_batch_size=8,
        eval_problems=64,
        eval_samples=1,
        eval_temperature=1.0,  # as the policy samples: what RL makes reliable
        run_dir="runs/screen-click",
    )


def digits() -> TrainConfig:
    """Tiny model, tiny task: reward rises within a few dozen steps on a CPU."""
    return TrainConfig(
        env="digits",
        actor=ActorConfig(model="tiny", lr=3e-3, max_grad_norm=1.0),
        algo=AlgoConfig(estimator="group_norm"),
        rollout=RolloutConfig(n_samples_per_prompt=4, prompts_per_step=8, max_new_tokens=8),
        steps=30,
        micro_batch_size=32,
        run_dir="runs/digits",
    )


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "math-tir": math_tir,
    "math-tir-easy": math_tir_easy,
    "agentrl/MathTIR-v0": math_tir,
    "screen-click": screen_click,
    "agentrl/ScreenClick-v0": screen_click,
    "digits": digits,
    "agentrl/Digits-v0": digits,
}


def preset_for(env: str) -> TrainConfig:
    """The preset registered for an env name, else the defaults with that env."""
    if env in PRESETS:
        return PRESETS[env]()
    return dataclasses.replace(TrainConfig(), env=env, run_dir=f"runs/{env.replace('/', '_')}")
