"""`agentrl train`: one RL run from a preset, an optional JSON config, and flags.

    agentrl train --env math-tir
    agentrl train --preset math-tir-easy
    agentrl train --env digits --algo.estimator rloo --actor.lr 1e-3 --steps 50
    agentrl train --config runs/x/config.json --resume auto
    agentrl train --dataset data.jsonl --reward_fn rewards.py:score

Order of precedence: flags > --config file > the preset (--preset NAME, else the env's own)
> defaults. Presets: math-tir (easy+medium, evaluated on medium), math-tir-easy, screen-click,
digits. Every check runs before a model is loaded; the resolved config is saved as
run_dir/config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agentrl.command_line import deferred_validation, parse_flags
from trainers.config import TrainConfig, config_from_dict
from trainers.presets import PRESETS, preset_for
from trainers.quiet import quiet_third_party


def build_config(argv: list[str]) -> TrainConfig:
    argv = _dataset_shorthand(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=None)
    pre.add_argument("--config", default=None)
    pre.add_argument("--preset", default=None)
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

    with deferred_validation():  # checked once, with the flags applied (by parse_flags)
        preset = PRESETS[known.preset]() if known.preset else preset_for(env)
        base = config_from_dict(file_cfg, preset)
        return parse_flags(TrainConfig, rest, prog="agentrl train", doc=__doc__, default=base)


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
