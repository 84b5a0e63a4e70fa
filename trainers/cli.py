"""`agentrl train`: one RL run from a preset, an optional JSON config, and flags.

    agentrl train --env math-tir
    agentrl train --env digits --algo.estimator rloo --actor.lr 1e-3 --steps 50
    agentrl train --config runs/x/config.json --resume auto

Order of precedence: flags > --config file > the env's preset > defaults. Every check runs
before a model is loaded; the resolved config is saved as run_dir/config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainers.config import TrainConfig, config_from_dict
from trainers.presets import preset_for


def build_config(argv: list[str]) -> TrainConfig:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=None)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    file_cfg: dict = {}
    if known.config:
        path = Path(known.config)
        if not path.is_file():
            raise ValueError(f"--config {path} does not exist")
        file_cfg = json.loads(path.read_text())
    env = known.env or file_cfg.get("env") or TrainConfig().env
    base = config_from_dict(file_cfg, preset_for(env))
    rest = _drop_flag(argv, "--config")

    import tyro

    from trainers.config import deferred_validation, validate

    with deferred_validation():
        cfg = tyro.cli(
            TrainConfig,
            default=base,
            args=rest,
            prog="agentrl train",
            description=__doc__,
            config=(tyro.conf.FlagConversionOff,),
            use_underscores=True,
        )
    return validate(cfg)


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
    from trainers.controller_run import run

    return run(cfg)
