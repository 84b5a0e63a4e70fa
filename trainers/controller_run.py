"""Runs a TrainConfig and prints the outcome (separate from cli.py so tests can call it)."""

from __future__ import annotations

import json
import sys

from trainers.config import TrainConfig


def run(cfg: TrainConfig) -> int:
    from agentrl.sandbox import SandboxUnavailableError
    from trainers.controller import Trainer, TrainingError

    try:
        summary = Trainer(cfg).run()
    except (TrainingError, SandboxUnavailableError) as e:  # the latter says how to fix it
        # A Ray worker's error is re-raised as its class too; `cause` is it without Ray's trace.
        print(f"agentrl train: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return 1
    except ValueError as e:  # a flag that does not fit the machine (checked before loading)
        print(f"agentrl train: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0
