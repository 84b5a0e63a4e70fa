"""LoRA and QLoRA through peft: low-rank adapters on a frozen base model.

`with_lora(model, ...)` wraps a model so that only its adapters train (peft's `get_peft_model`).
The trainers keep one model in memory: the reference of RL and DPO is the same model with its
adapters switched off (`adapters_off`), and engines that hold their own weights get the merged
ones, W + scale * B A, under the base model's names (`merged_weights`), as does the final
export (`save_merged`). A model sharded over ranks (FSDP2, ZeRO) merges the same way, from the
full state its backend gathers. `load_in_4bit` (QLoRA) quantizes the frozen base with bitsandbytes
(NF4; CUDA GPUs and CPUs alike), whose packed weights the merge dequantizes.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

ALL_LINEAR = "all-linear"

# On CPUs with AVX512-BF16, importing bitsandbytes (peft does whenever it is installed) warns
# that it could not fetch a faster kernel from the Hugging Face hub and advises installing a
# package that would download it at run time. agentrl downloads nothing: bitsandbytes' own CPU
# kernels run, and the advice is noise.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


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


def _quant_state(model: nn.Module, name: str, tensor: Tensor | None) -> Any:
    """The bitsandbytes quantization state of `name` where it is a 4-bit weight (QLoRA packs
    two values a byte into uint8, `Params4bit.quant_state` says how), else None."""
    if tensor is None or tensor.dtype != torch.uint8:
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
    if getattr(base, "hf_quantizer", None) is not None:
        # QLoRA: transformers saves a quantized model's own packed tensors whatever state dict
        # it is given, with a config saying so. The merged weights are plain: save them as a
        # plain model of the same architecture (built on the meta device: no memory).
        config = copy.deepcopy(base.config)
        del config.quantization_config
        generation = base.generation_config
        with torch.device("meta"):
            base = type(base)._from_config(config)
        base.generation_config = generation
    # The state dict of the base model's own layout: peft's wrappers renamed nothing else.
    base.save_pretrained(path, state_dict={k: v.contiguous() for k, v in weights.items()})
    tokenizer.save_pretrained(path)


def save_trained(model: Any, tokenizer: Any, path: Path,
                 state: Mapping[str, Tensor] | None = None) -> None:
    """What a run leaves at its end, at `path` (RUN_DIR/hf): a plain Hugging Face directory of
    the trained model; with LoRA the merged model, and the adapters beside it as RUN_DIR/adapter
    (peft's format, what --merge reads). `state`: the model's full state dict where it is
    sharded over ranks (gathered by its backend; rank 0 writes); None: the model holds it."""
    if is_lora(model):
        model.save_pretrained(str(path.parent / "adapter"), state_dict=state)
        save_merged(model, tokenizer, path, state)
        return
    # save_pretrained empties the state dict it is given.
    model.save_pretrained(path, state_dict=None if state is None else dict(state))
    tokenizer.save_pretrained(path)


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def check_4bit_device(device: torch.device) -> None:
    """ValueError unless bitsandbytes' 4-bit kernels run on `device` here: CUDA GPUs, x86-64
    CPUs with AVX2 (its minimum) and ARM CPUs."""
    import importlib.util
    import platform

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("--actor.load_in_4bit (QLoRA) needs bitsandbytes: "
                         "pip install bitsandbytes==0.50.2")
    if device.type == "cpu":
        arch, capability = platform.machine().lower(), torch.backends.cpu.get_cpu_capability()
        if arch in ("x86_64", "amd64"):
            ok = capability in ("AVX2", "AVX512")
        else:
            ok = arch in ("aarch64", "arm64")
        why = f"this CPU ({arch}, {capability}) has no AVX2"
    else:
        ok, why = device.type == "cuda", f"the device is {device}"
    if not ok:
        raise ValueError(f"--actor.load_in_4bit (QLoRA): bitsandbytes' 4-bit kernels run on "
                         f"CUDA GPUs, x86-64 CPUs with AVX2 and ARM CPUs; {why}. Use "
                         f"--actor.lora_rank without it (LoRA on the full-precision base)")


def quantized_base(name: str, dtype: str, device: torch.device) -> Any:
    """The frozen base model in 4 bits (NF4) for QLoRA, computing in `dtype` (bf16 matmuls
    come from --actor.mixed_precision's autocast, as for any weight); a clear error where
    bitsandbytes cannot run. Gradient checkpointing stays --actor.gradient_checkpointing's."""
    check_4bit_device(device)
    from peft import prepare_model_for_kbit_training

    from agentrl.models import load_model

    model = prepare_model_for_kbit_training(load_model(name, dtype=dtype, four_bit_on=device),
                                            use_gradient_checkpointing=False)
    for module in model.modules():
        if _quant_state(module, "weight", module._parameters.get("weight")) is not None:
            module.register_load_state_dict_pre_hook(_load_packed_weight)
            # On CPUs with AVX512-BF16, bitsandbytes repacks a layer's weight in place the first
            # time it runs in eval mode without grad (an eval loss), into a layout for its bf16
            # inference kernel, which every later pass then takes. Measured on the tiny model
            # after one eval pass: the next training pass gave layer 0's adapters a zero
            # gradient, and the merged weights computed logits 0.02 off the model's. Off: every
            # forward computes as training does.
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    return model


def _load_packed_weight(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load-state hook of a 4-bit layer: a checkpoint holds its packed weight and, beside it,
    the packing state (`weight.absmax`, `weight.quant_map`, ...), which torch does not expect.
    The base is frozen, so the checkpoint's packed weight must be the layer's own: it is
    checked, and the packing state it came with dropped."""
    key = prefix + "weight"
    for extra in [k for k in state if k.startswith(key + ".")]:
        del state[extra]
    own = module.get_parameter("weight")
    if key in state and not torch.equal(state[key].to(own.device), own):
        raise ValueError(f"{key}: the 4-bit base in this checkpoint is not the model's; resume "
                         f"with the run's own --actor.model")
