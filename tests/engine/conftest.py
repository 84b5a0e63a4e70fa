"""Engine fixtures: a tiny Llama with sharpened weights, so greedy decoding is not degenerate."""

from __future__ import annotations

import pytest

from ._models import sharp_tiny_model


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return sharp_tiny_model(tiny_tokenizer)


@pytest.fixture
def engine(model, tiny_tokenizer):
    from agentrl.engine.transformers_engine import TransformersEngine

    eng = TransformersEngine(model, tiny_tokenizer, max_batch_size=8)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = [
        "What is 2 + 3?",
        "hello world",
        "The quick brown fox jumps over",
        "Reverse the word: cat",
        "Guess a number between 1 and 100.",
        "user assistant system tool",
    ]
    return [tiny_tokenizer.encode(t) for t in texts]
