"""Named presets: Python functions returning a TrainConfig. `agentrl train --env X` starts from
the preset registered for X (if any), then applies --config and flags on top."""

from __future__ import annotations

from collections.abc import Callable

from trainers.config import ActorConfig, AlgoConfig, RolloutConfig, TrainConfig


def math_tir() -> TrainConfig:
    """The headline run: GRPO on tool-integrated arithmetic with the embedded SmolLM2-135M,
    sized to finish in under 15 minutes on a 2-core CPU (see README for what was measured)."""
    return TrainConfig(
        env="math-tir",
        env_kwargs={"split": "train", "tasks": "basic_arithmetic", "difficulty": "easy"},
        eval_env_kwargs={"split": "eval"},
        actor=ActorConfig(lr=1e-5),
        algo=AlgoConfig(estimator="group_norm"),
        rollout=RolloutConfig(
            n_samples_per_prompt=4, prompts_per_step=4, max_new_tokens=64, max_turns=2,
            max_episode_tokens=512,
        ),
        steps=12,
        micro_batch_size=8,
        eval_problems=32,
        eval_samples=2,
        eval_temperature=1.0,
        run_dir="runs/math-tir",
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
    "agentrl/MathTIR-v0": math_tir,
    "screen-click": screen_click,
    "agentrl/ScreenClick-v0": screen_click,
    "digits": digits,
    "agentrl/Digits-v0": digits,
}


def preset_for(env: str) -> TrainConfig:
    """The preset registered for an env name, else the defaults with that env."""
    import dataclasses

    if env in PRESETS:
        return PRESETS[env]()
    return dataclasses.replace(TrainConfig(), env=env, run_dir=f"runs/{env.replace('/', '_')}")
