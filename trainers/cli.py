"""`agentrl train`: one RL run from a preset, an optional JSON config, and flags.

    agentrl train --env math-tir
    agentrl train --preset math-tir-easy
    agentrl train --env digits --algo.estimator rloo --actor.lr 1e-3 --steps 50
    agentrl train --config runs/x/config.json --resume auto
    agentrl train --dataset data.jsonl --reward_fn rewards.py:score
    agentrl train --preset kv-agent --agent examples/agents/openai_agents_kv.py:agent

Order of precedence: flags > --config file > the preset (--preset NAME, else the env's own)
> defaults. Presets: math-tir (easy+medium, evaluated on medium), math-tir-easy, screen-click,
digits, kv-agent (a task for the agent that --agent names). A preset's learning rate is its
model's: --actor.model takes the rate the preset measured for that model, and a model it was
not measured on needs --actor.lr. Every check runs before Ray starts or a model is loaded (a
model its engine or env cannot use included); the resolved config is saved as
run_dir/config.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from agentrl.command_line import deferred_validation, parse_flags
from trainers.config import TrainConfig, check_model, check_model_name, config_from_dict
from trainers.presets import PRESETS, preset_for
from trainers.quiet import quiet_third_party


def build_config(argv: list[str]) -> TrainConfig:
    argv = _dataset_shorthand(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=None)
    pre.add_argument("--config", default=None)
    pre.add_argument("--preset", default=None)
    pre.add_argument("--actor.model", dest="model", default=None)
    pre.add_argument("--actor.lr", dest="lr", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.preset is not None and known.preset not in PRESETS:
        raise ValueError(f"--preset {known.preset!r} is not a preset; choose one of "
                         f"{', '.join(sorted(PRESETS))}")
    file_cfg: dict = {}
    if known.config:
        path = Path(known.config)
        if not path.is_file():
            raise ValueError(f"--config {path} does not exist")
        file_cfg = json.loads(path.read_text())
    dataset = any(a == "--dataset.path" or a.startswith("--dataset.path=") for a in argv)
    env = known.env or file_cfg.get("env") or ("single-turn" if dataset else TrainConfig().env)
    rest = _drop_flag(_drop_flag(argv, "--config"), "--preset")

    # A preset's learning rate is its model's: another model takes the rate the preset measured
    # for it, or needs --actor.lr (#34).
    file_actor = file_cfg.get("actor", {})
    model = known.model or file_actor.get("model")
    lr_given = known.lr is not None or "lr" in file_actor
    if model is not None:
        check_model_name(model)  # before a preset looks its learning rate up
    with deferred_validation():  # checked once, with the flags applied (by parse_flags)
        preset = preset_for(known.preset or env, model, lr_given=lr_given)
        base = _agent_evals(config_from_dict(file_cfg, preset), argv)
        cfg = parse_flags(TrainConfig, rest, prog="agentrl train", doc=__doc__, default=base)
    check_model(cfg)  # the model against its engine and env, before Ray or a model starts
    return cfg


def _agent_evals(base: TrainConfig, argv: list[str]) -> TrainConfig:
    """An agent run is evaluated on its own held-out tasks (--agent_eval_tasks), never on the
    preset env's problems: without that file the preset's evals are off (issue #32)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--agent", "--agent_cmd", "--agent_eval_tasks"):
        pre.add_argument(flag, default=None)
    known, _ = pre.parse_known_args(argv)
    agent = known.agent or known.agent_cmd or base.agent_run
    if not agent or known.agent_eval_tasks or base.agent_eval_tasks:
        return base
    return dataclasses.replace(base, eval_problems=0, eval_every=0, keep_best=None)


def _dataset_shorthand(argv: list[str]) -> list[str]:
    """`--dataset PATH` (or `--dataset=PATH`) is `--dataset.path PATH`; with it and no --env,
    the run is the single-turn env's."""
    out = []
    for a in argv:
        if a == "--dataset":
            a = "--dataset.path"
        elif a.startswith("--dataset="):
            a = "--dataset.path=" + a.partition("=")[2]
        out.append(a)
    return out


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def main(argv: list[str]) -> int:
    try:
        cfg = build_config(argv)
    except ValueError as e:
        print(f"agentrl train: {e}", file=sys.stderr)
        return 2
    quiet_third_party()
    from trainers.controller_run import run

    return run(cfg)
