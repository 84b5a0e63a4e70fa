"""Sampling engines: the `Engine` protocol and its backends (transformers default, vLLM optional).

    engine = create_engine("smollm2-135m-instruct")            # or a model object
    [c] = await engine.generate(prompt_ids, SamplingParams(max_tokens=64))

Backends import torch/transformers/vllm lazily; importing this package does not.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

from agentrl.engine.base import Engine, GenerationError, NamedTensors, PromptTooLongError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

BACKENDS = ("transformers", "vllm")


def create_engine(
    model: str | PreTrainedModel,
    *,
    backend: str = "transformers",
    tokenizer: PreTrainedTokenizerBase | str | None = None,
    **kwargs: Any,
) -> Engine:
    """Build an engine for `model` (a name/path known to `agentrl.models`, or a loaded model).

    `backend="transformers"` (default, CPU and GPU) or `"vllm"` (GPU, `pip install agentrl[vllm]`,
    needs a name or path). Extra keyword arguments go to the backend's constructor.
    """
    if backend not in BACKENDS:
        hint = difflib.get_close_matches(backend, BACKENDS, n=1)
        did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
        raise ValueError(
            f"unknown engine backend {backend!r}.{did_you_mean} Choose from {BACKENDS}"
        )
    if backend == "vllm":
        from agentrl.engine.vllm import VLLMEngine

        if not isinstance(model, str):
            raise TypeError(
                "the vllm backend loads the model itself: pass a model name or local path, "
                f"not a {type(model).__name__}"
            )
        return VLLMEngine(model, **kwargs)
    from agentrl.engine.hf import TransformersEngine
    from agentrl.models import load_model, load_tokenizer

    if isinstance(model, str):
        tokenizer = tokenizer if tokenizer is not None else model
        model = load_model(model)
    if tokenizer is None:
        name = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
        if not name:
            raise ValueError("create_engine(model_object) needs tokenizer= (an object or a name)")
        tokenizer = name
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    return TransformersEngine(model, tokenizer, **kwargs)


__all__ = [
    "BACKENDS",
    "Engine",
    "GenerationError",
    "NamedTensors",
    "PromptTooLongError",
    "create_engine",
]
