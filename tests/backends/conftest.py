"""Backend fixtures: the engine tests' tiny models and prompts, the trainer tests' configs and
recorded rollouts."""

from __future__ import annotations

from tests.engine.conftest import model, prompts
from tests.trainers.conftest import make_cfg, recorded_rollouts

__all__ = ["make_cfg", "model", "prompts", "recorded_rollouts"]
