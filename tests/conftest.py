"""Shared fixtures: the tiny tokenizer/model (built in-process) and the embedded tokenizer."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from agentrl.models import load_tokenizer

    return load_tokenizer("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    from agentrl.models.tiny import tiny_model

    return tiny_model(tiny_tokenizer)


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from agentrl.models import load_tokenizer

    return load_tokenizer("embedded")
