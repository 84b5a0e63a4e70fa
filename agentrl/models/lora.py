"""LoRA and QLoRA through peft: low-rank adapters on a frozen base model.

`with_lora(model, ...)` wraps a model so that only its adapters train (peft's `get_peft_model`).
The trainers keep one model in memory: the reference of RL and DPO is the same model with its
adapters switched off (`adapters_off`), and engines that hold their own weights get the merged
ones, W + scale * B A, under the base model's names (`merged_weights`), as does the final
export (`save_merged`). A model sharded over ranks (FSDP2, ZeRO) merges the same way, from the
full state its backend gathers. `load_in_4bit` (QLoRA) quantizes the frozen base with bitsandbytes,
which needs a CUDA GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

ALL_LINEAR = "all-linear"


def with_lora(model: Any, *, rank: int, alpha: int, targets: Sequence[str] = (),
              dropout: float = 0.0) -> Any:
    """`model` with rank-`rank` adapters on the `targets` modules (default: every linear
    layer but the output head); the base weights are frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError("LoRA needs the peft package: pip install peft") from None
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none",
                        target_modules=list(targets) if targets else ALL_LINEAR)
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                        if isinstance(m, nn.Linear)})
        raise ValueError(f"--actor.lora_targets {list(targets)}: {e}; this model's linear "
                         f"layers are {names}") from None


def load_policy(name: str, *, dtype: str, device: torch.device, lora_rank: int = 0,
                lora_alpha: int = 16, lora_targets: Sequence[str] = (),
                lora_dropout: float = 0.0, load_in_4bit: bool = False) -> Any:
    """The model a trainer trains: `name` in full, or frozen (in 4 bits with `load_in_4bit`)
    with LoRA adapters when `lora_rank` > 0."""
    from agentrl.models import load_model

    if load_in_4bit:
        model = quantized_base(name, dtype, device)
    else:
        model = load_model(name, dtype=dtype)
    if lora_rank > 0:
        model = with_lora(model, rank=lora_rank, alpha=lora_alpha, targets=lora_targets,
                          dropout=lora_dropout)
    return model.train()


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """The base model's outputs, for a reference model that costs no memory."""
    with model.disable_adapter():
        yield


def _lora_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def _base_name(name: str) -> str:
    """peft's parameter name as the plain model has it."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def merged_weights(model: nn.Module, state: Mapping[str, Tensor] | None = None
                   ) -> dict[str, Tensor]:
    """The weights of the model the adapters amount to, W + scale * B A, under the plain
    model's names (what an engine loads, and what an export saves). The model is unchanged.

    `state`: the full state dict of `model` where it is sharded over ranks (the backend's
    `full_weights`, gathered: FSDP2 and ZeRO-3 ranks hold slices of W, A and B); default, the
    model's own. Only the adapters' scales are read from `model`, so one function merges for one
    process and for many; an empty `state` (a rank the gather left out) gives an empty dict.
    `model` may also be a module around the peft model (a reward model's ValueModel): names are
    relative to it."""
    state = model.state_dict() if state is None else state
    # base weight's name -> (A's name, B's name, scale)
    adapters: dict[str, tuple[str, str, float]] = {}
    for name, layer in _lora_layers(model):
        adapter = layer.active_adapters[0]
        if adapter in layer.lora_A:
            adapters[f"{name}.base_layer.weight"] = (f"{name}.lora_A.{adapter}.weight",
                                                     f"{name}.lora_B.{adapter}.weight",
                                                     layer.scaling[adapter])
    packed = {name for name, t in state.items() if _quant_state(model, name, t) is not None}
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():  # tied weights under each of their names
        head, dot, _ = name.rpartition(".weight.")
        if "lora_" in name or (dot and f"{head}.weight" in packed):
            continue  # an adapter, or what bitsandbytes saves beside a 4-bit weight
        weight = tensor.detach()
        if name in packed:  # QLoRA's 4-bit base: the values it stands for
            import bitsandbytes.functional as bnb_functional

            weight = bnb_functional.dequantize_4bit(weight, _quant_state(model, name, tensor))
        if name in adapters:
            a, b, scale = adapters[name]
            weight = weight + ((state[b] @ state[a]) * scale).to(weight.dtype)
        out[_base_name(name)] = weight
    return out


def _quant_state(model: nn.Module, name: str, tensor: Tensor) -> Any:
    """The bitsandbytes quantization state of `name` where it is a 4-bit weight (QLoRA packs
    two values a byte into uint8, `Params4bit.quant_state` says how), else None."""
    if tensor.dtype != torch.uint8:
        return None
    try:
        param = model.get_parameter(name)
    except AttributeError:
        return None
    return getattr(param, "quant_state", None)


def save_merged(model: nn.Module, tokenizer: Any, path: str | Path,
                state: Mapping[str, Tensor] | None = None) -> None:
    """A plain Hugging Face directory of the merged model (loads without peft); `state` as for
    `merged_weights`."""
    base = model.get_base_model()  # type: ignore[operator]
    weights = merged_weights(model, state)
    # The state dict of the base model's own layout: peft's wrappers renamed nothing else.
    base.save_pretrained(path, state_dict={k: v.contiguous() for k, v in weights.items()})
    tokenizer.save_pretrained(path)


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def quantized_base(name: str, dtype: str, device: torch.device) -> Any:
    """The base model in 4 bits (NF4, bf16 compute) for QLoRA; a clear error where
    bitsandbytes cannot run."""
    if device.type != "cuda":
        raise ValueError(f"--actor.load_in_4bit (QLoRA) needs a CUDA GPU (bitsandbytes' 4-bit "
                         f"kernels); the device is {device}. Use --actor.lora_rank without it")
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("--actor.load_in_4bit needs bitsandbytes: pip install bitsandbytes")
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from agentrl.models import model_dir

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir(name)), quantization_config=quant, device_map={"": device.index or 0},
        dtype=getattr(torch, dtype))
    return prepare_model_for_kbit_training(model)
