"""Named models that upper layers provide: a name (`--actor.model embedded-vlm`) that resolves
to a model directory its provider builds or finds, with no path to pass.

A provider registers a function returning the directory, in code (`register_model`) or through
the `agentrl.models` entry-point group of an installed package (the built-in `embedded-vlm` is
registered that way by environments/screenshot, whose tasks it is built from). Entry points
are listed by name without importing them; the provider's module is imported only when its
model is loaded.
"""

from __future__ import annotations

import importlib.metadata
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
