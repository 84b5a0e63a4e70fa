"""Named models that upper layers provide: a name (`--actor.model embedded-vlm`) that resolves
to a model directory its provider builds or finds, with no path to pass.

A provider registers a function returning the directory, in code (`register_model`) or through
the `agentrl.models` entry-point group of an installed package (the built-in `embedded-vlm` is
registered that way by environments/screenshot, whose tasks it is built from). Entry points
are listed by name without importing them; the provider's module is imported only when its
model is loaded.

What a name says before anything is built (`built_in_memory`, `sees_images`,
`check_engine_loads`) is told here too, from the name or a directory's config.json, so that
`agentrl train`, `eval` and `rollout` refuse a model that cannot work before Ray, an engine or a
model starts.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable
from pathlib import Path

MODEL_ENTRY_POINT_GROUP = "agentrl.models"

_REGISTERED: dict[str, Callable[[], Path]] = {}


def register_model(name: str, directory: Callable[[], Path]) -> None:
    """Make `name` loadable by `load_model`/`load_tokenizer`: `directory()` returns (building
    it on first use, if it must) a Hugging Face model directory."""
    if not name or "/" in name:
        raise ValueError(f"a model name is a plain word like 'my-model', got {name!r}")
    _REGISTERED[name] = directory


def named_models() -> list[str]:
    """Every registered name: in code and through installed entry points."""
    eps = importlib.metadata.entry_points(group=MODEL_ENTRY_POINT_GROUP)
    return sorted({*_REGISTERED, *(ep.name for ep in eps)})


def named_model_dir(name: str) -> Path | None:
    """The directory of the model registered as `name` (built if needed), or None if no
    provider registered that name."""
    if name not in _REGISTERED:
        for ep in importlib.metadata.entry_points(group=MODEL_ENTRY_POINT_GROUP, name=name):
            directory = ep.load()
            if not callable(directory):
                raise TypeError(f"the {MODEL_ENTRY_POINT_GROUP} entry point {name!r} "
                                f"({ep.value}) must name a function returning a directory")
            _REGISTERED[name] = directory
            break
        else:
            return None
    return Path(_REGISTERED[name]())


def canonical_model_name(name: str) -> str:
    """`name` with the embedded model's aliases (`embedded`, `default`,
    `HuggingFaceTB/SmolLM2-135M-Instruct`, ...) spelled smollm2-135m-instruct; any other name or
    path as given."""
    from agentrl.models.embedded import EMBEDDED_ALIASES, EMBEDDED_NAME

    if name.lower() in {a.lower() for a in EMBEDDED_ALIASES}:  # as agentrl.models resolves it
        return EMBEDDED_NAME
    return name


def built_in_memory(name: str) -> bool:
    """Whether model `name` has no directory, being built in memory when loaded: the built-in
    tiny test models (`tiny`, `tiny-qwen2-vl`, ...). A local directory, the embedded model and
    every registered name have one, which a library that loads the model itself (vLLM) reads.
    Builds nothing."""
    from agentrl.models.tiny import TINY_NAME, TINY_THINK, TINY_VLMS

    return name in (TINY_NAME, TINY_THINK, *TINY_VLMS) and not _registered(name)


def sees_images(name: str) -> bool | None:
    """Whether model `name` is a vision-language model, told from its name or its directory's
    config.json without loading it; None where that cannot be told without building it (a
    registered name) or the name is not a model."""
    from agentrl.models.embedded import EMBEDDED_NAME
    from agentrl.models.tiny import TINY_NAME, TINY_THINK, TINY_VLMS

    if canonical_model_name(name) == EMBEDDED_NAME:
        return False
    if _registered(name):
        return None
    if name in (TINY_NAME, TINY_THINK, *TINY_VLMS):
        return name in TINY_VLMS
    config = Path(name).expanduser() / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return None


def check_engine_loads(engine: str, model: str, *, engine_flag: str, model_flag: str) -> None:
    """ValueError, in one line naming both flags and the fix, where `engine` cannot load `model`:
    vLLM loads the model from its directory, which the tiny models built in memory lack. Builds
    and imports nothing heavy, so a command runs it before anything starts."""
    if engine != "vllm" or not built_in_memory(model):
        return
    from agentrl.models.embedded import EMBEDDED_NAME

    vision = sees_images(model)
    fix = f"{model_flag} {EMBEDDED_NAME} (the embedded model)"
    if vision and _VISION_MODEL in named_models():
        fix = f"{model_flag} {_VISION_MODEL} (the embedded vision-language model)"
    elif vision:
        fix = f"{model_flag} DIR (a vision-language model's directory)"
    raise ValueError(
        f"{engine_flag} vllm loads the model from a directory, but {model_flag} {model} is built "
        f"in memory and has none: use {fix}, a directory `save_pretrained` wrote, or "
        f"{engine_flag} transformers"
    )


_VISION_MODEL = "embedded-vlm"
"""The named vision-language model suggested in place of a tiny one, where it is installed."""


def _registered(name: str) -> bool:
    """Whether a provider registered `name`, in code or by an entry point (not imported)."""
    if name in _REGISTERED:
        return True
    return bool(importlib.metadata.entry_points(group=MODEL_ENTRY_POINT_GROUP, name=name))
