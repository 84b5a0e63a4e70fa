"""Shared fixtures: the tiny tokenizer/model (built in-process) and the embedded tokenizer."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests need a CUDA device: skipped (with the reason) where there is none."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


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
