"""Rollout fixtures: an engine over the tiny model, and env factories."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    from agentrl.engine.transformers_engine import TransformersEngine
    from agentrl.models.tiny import tiny_model

    eng = TransformersEngine(tiny_model(tiny_tokenizer), tiny_tokenizer, max_batch_size=32, seed=0)
    yield eng
    eng.close()
