"""Named presets: Python functions returning a TrainConfig. `agentrl train --env X` starts from
the preset registered for X (if any), then applies --config and flags on top.

A preset's learning rate belongs to the model it was measured on: each preset records the rates
measured per model (`LEARNING_RATES`), `--actor.model` picks that model's, and a model the
preset was not measured on needs --actor.lr (`preset_for` refuses it otherwise)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from agentrl.models.embedded import EMBEDDED_NAME
from agentrl.models.named import canonical_model_name
from environments.kv_lookup import task_file
from trainers.config import ActorConfig, AlgoConfig, RolloutConfig, TrainConfig, WarmupConfig

MATH_TIR_LRS = {EMBEDDED_NAME: 2e-5}
"""math-tir's learning rate per model (benchmarks/results/math_tir_medium.md: at 20 steps on an
AVX2-only 2-core CPU, 2e-5 reached 0.625 (seed 0, 13 min 20 s) and 0.375 (seed 1), where 1e-5
at 25 steps reached 0.422 and 0.281 in 17-18 min)."""
MATH_TIR_EASY_LRS = {EMBEDDED_NAME: 1e-5}
"""math-tir-easy's learning rate per model (benchmarks/results/math_tir_default_run.md)."""
SCREEN_CLICK_LRS = {"embedded-vlm": 2e-5}
KV_AGENT_LRS = {EMBEDDED_NAME: 2e-5}
"""kv-agent's learning rate per model: math-tir's, one run (benchmarks/results/
agent_headline.md)."""
MINIWOB_LRS = {EMBEDDED_NAME: 3e-5}
"""miniwob's learning rate per model: one timed run (benchmarks/results/miniwob_headline.md);
by step 8 the policy's entropy is ~0 (it answers one ref per task)."""
DIGITS_LRS = {"tiny": 3e-3, EMBEDDED_NAME: 3e-5}
"""digits' learning rate per model. The tiny model's 3e-3 takes the embedded model's entropy
from 3.3 to 0.8 in one step and to 0 in two (reward 0 after); 3e-5 lowers it step by step while
reward reaches ~1.0 by step 7 (benchmarks/results/digits_learning_rates.md)."""


def math_tir() -> TrainConfig:
    """The headline run: GRPO on tool-integrated arithmetic with the embedded SmolLM2-135M,
    trained on a mix of easy and medium problems and evaluated on held-out medium ones, which
    the base model cannot solve (pass@1 ~0): the easy half teaches the tool protocol, which
    then carries over to the medium half. Sized to finish within 15 minutes on a 2-core CPU
    (benchmarks/results/math_tir_medium.md has the runs and the levers measured; 20 steps at lr
    2e-5 took 13 min 20 s on an AVX2-only EPYC, ~29 s a step)."""
    return TrainConfig(
        env="math-tir",
        env_kwargs={"split": "train", "tasks": "basic_arithmetic", "difficulty": "easy,medium"},
        eval_env_kwargs={"split": "eval", "difficulty": "medium"},
        actor=ActorConfig(lr=MATH_TIR_LRS[EMBEDDED_NAME]),
        algo=AlgoConfig(estimator="group_norm"),
        rollout=RolloutConfig(
            n_samples_per_prompt=4, prompts_per_step=4, max_new_tokens=64, max_turns=2,
            max_episode_tokens=512,
        ),
        steps=20,
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
    cfg = math_tir()
    return dataclasses.replace(
        cfg,
        actor=dataclasses.replace(cfg.actor, lr=MATH_TIR_EASY_LRS[EMBEDDED_NAME]),
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
        actor=ActorConfig(model="embedded-vlm", lr=SCREEN_CLICK_LRS["embedded-vlm"]),
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


def kv_agent() -> TrainConfig:
    """The agent headline (#32 item 1): GRPO on an agent you bring, written with any framework
    (`--agent`, e.g. examples/agents/openai_agents_kv.py, an OpenAI Agents SDK agent), on
    key-value lookups whose answers only the agent's tools can read (environments/kv_lookup:
    a random store per task), with the embedded SmolLM2-135M as its model. Evaluated before
    and after on 32 held-out tasks whose keys training never shows. Measured alone on a 2-core
    AVX2 EPYC: held-out success 0.156 -> 0.938 in 13 min 58 s, 10 steps of ~60 s
    (benchmarks/results/agent_headline.md, run r5).
    Without --agent (or --agent_cmd) the run is refused: the preset is the task, not the agent
    (so a direct caller builds it under agentrl.command_line.deferred_validation and sets
    `agent`, as `agentrl train` does)."""
    return TrainConfig(
        agent_tasks=task_file("train"),
        agent_eval_tasks=task_file("eval"),
        agent_reward="environments.kv_lookup:reward",
        actor=ActorConfig(lr=KV_AGENT_LRS[EMBEDDED_NAME]),
        algo=AlgoConfig(estimator="group_norm"),
        # max_new_tokens caps a call that sets no max_tokens (the example agents set 48).
        rollout=RolloutConfig(n_samples_per_prompt=4, prompts_per_step=4, max_new_tokens=48),
        steps=10,
        micro_batch_size=8,
        eval_problems=32,
        eval_samples=1,
        run_dir="runs/kv-agent",
    )


def miniwob() -> TrainConfig:
    """The web-agent headline (#33 item 3): six MiniWoB++ tasks of one to three actions (the
    click-basics suite: click-button, click-link, click-dialog, click-tab, focus-text,
    enter-text) in a real headless Chromium, with the embedded SmolLM2-135M reading the page as
    text (`dom` mode, one example exchange in the prompt). A supervised warm-up first: 56
    scripted episodes of the warm-up suite (seven other MiniWoB++ tasks; none of click-basics'
    pages), imitated for 2 epochs; then 14 GRPO steps. Evaluated on 48 held-out pages (8 per
    task, new seeds, T=1) before, after the warm-up and after RL, with per-task lines. Measured
    alone on a 2-core AVX2 EPYC: held-out success 0.104 -> 0.396 (warm-up) -> 0.625 in 13 min
    13 s, and with --seed 1 0.125 -> 0.542 -> 0.625 in 13 min 34 s; click-button, click-link and
    click-tab stay low (benchmarks/results/miniwob_headline.md)."""
    return TrainConfig(
        env="miniwob",
        # A page load may wait its turn on 2 cores while 16 browsers start: 60 s, not 20.
        env_kwargs={"task": "click-basics", "observation": "dom", "split": "train",
                    "timeout_s": 60.0},
        eval_env_kwargs={"split": "eval"},
        actor=ActorConfig(lr=MINIWOB_LRS[EMBEDDED_NAME]),
        algo=AlgoConfig(estimator="group_norm"),
        # An action is ~5-10 tokens; the cap keeps a rambling answer cheap. The env is told the
        # turn budget, so a failed episode ends with MiniWoB's -1; the token budget is set above
        # what two turns on these pages take (a cut episode would score 0, better than a
        # failure). Concurrency bounds the browsers (one per episode in flight) as well as the
        # engine's batch.
        rollout=RolloutConfig(
            n_samples_per_prompt=6, prompts_per_step=4, max_new_tokens=12, max_turns=2,
            max_episode_tokens=2048, max_concurrency=16,
        ),
        # A supervised warm-up on other MiniWoB++ tasks (the scripted policy's episodes on
        # the warm-up suite: none of click-basics' tasks), evaluated before RL starts.
        warmup=WarmupConfig(episodes=56, epochs=2, env_kwargs={"task": "warm-up",
                                                               "max_turns": 3}),
        steps=14,
        micro_batch_size=8,
        eval_problems=48,
        eval_samples=1,
        eval_temperature=1.0,
        run_dir="runs/miniwob",
    )


def digits() -> TrainConfig:
    """Tiny model, tiny task: reward rises within a few dozen steps on a CPU. With
    `--actor.model smollm2-135m-instruct` the rate measured for it (`DIGITS_LRS`)."""
    return TrainConfig(
        env="digits",
        actor=ActorConfig(model="tiny", lr=DIGITS_LRS["tiny"], max_grad_norm=1.0),
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
    "kv-agent": kv_agent,
    "miniwob": miniwob,
    "agentrl/MiniWoB-v0": miniwob,
}


LEARNING_RATES: dict[Callable[[], TrainConfig], dict[str, float]] = {
    math_tir: MATH_TIR_LRS,
    math_tir_easy: MATH_TIR_EASY_LRS,
    screen_click: SCREEN_CLICK_LRS,
    kv_agent: KV_AGENT_LRS,
    miniwob: MINIWOB_LRS,
    digits: DIGITS_LRS,
}
"""Each preset's learning rate for each model it was measured on (the preset's own model
first)."""


def preset_for(name: str, model: str | None = None, *, lr_given: bool = False) -> TrainConfig:
    """The preset registered as `name` (a preset's or an env's name), else the defaults with that
    env. With `model` (--actor.model) other than the preset's own: the preset with the learning
    rate it records for that model; for a model it was not measured on a ValueError naming
    --actor.lr, unless the rate is given (`lr_given`: by --actor.lr or the --config file)."""
    if name not in PRESETS:
        return dataclasses.replace(TrainConfig(), env=name,
                                   run_dir=f"runs/{name.replace('/', '_')}")
    cfg = PRESETS[name]()
    own = canonical_model_name(cfg.actor.model)
    if model is None or lr_given or canonical_model_name(model) == own:
        return cfg
    rates = LEARNING_RATES[PRESETS[name]]
    lr = rates.get(canonical_model_name(model))
    if lr is None:
        measured = " and ".join(f"{m} (--actor.lr {r:g})" for m, r in rates.items())
        raise ValueError(f"the {name} preset's learning rate was measured with {measured} only; "
                         f"--actor.model {model} needs --actor.lr too (a rate for that model, e.g. "
                         f"{TrainConfig().actor.lr:g} as without a preset)")
    return dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, model=model, lr=lr))
