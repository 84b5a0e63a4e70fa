"""The one loader of code named by a string: `package.module:attr` or `path/to/file.py:attr` (a
file that need not be importable by name). Commands, env entry points, training backends and
user functions named on the command line all load through `load_attr`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any


def load_module_file(path: str | Path) -> ModuleType:
    """Import a Python file by its path (registered in sys.modules under a private name, so
    what it defines pickles by reference in this process)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist")
    name = f"agentrl_user_{path.stem}_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_attr(spec: str | None, what: str = "function") -> Any:
    """The object named by `package.module:attr` or `path/to/file.py:attr` (`what` names it in
    errors)."""
    where, _, attr = (spec or "").rpartition(":")
    if not where or not attr:
        raise ValueError(f"expected 'package.module:{what}' or 'file.py:{what}', got {spec!r}")
    module = load_module_file(where) if where.endswith(".py") else importlib.import_module(where)
    if not hasattr(module, attr):
        raise ValueError(f"{spec!r}: {where} defines no {attr!r}")
    return getattr(module, attr)


def load_callable(spec: str | None, what: str = "function") -> Callable[..., Any]:
    """The callable named by `package.module:function` or `path/to/file.py:function`."""
    fn = load_attr(spec, what)
    if not callable(fn):
        # ValueError, not TypeError: a bad flag value, which the CLIs report as such.
        raise ValueError(f"{spec!r} is not a callable but a {type(fn).__name__}")  # noqa: TRY004
    return fn
