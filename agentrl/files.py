"""Atomic writes: a reader sees a file's (or a directory's) old content or its new, never part
of it, and two writers never share a temporary name.

Everything is written beside its target under a name no other writer uses,
`.NAME.<pid>.<random>.tmp`, then renamed over it. A crash leaves at most such a hidden file;
`partial_writes(folder)` finds them for whoever cleans up.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

_SUFFIX = ".tmp"


def temp_path_beside(path: str | Path) -> Path:
    """A name in `path`'s folder that no other process or thread uses."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{_SUFFIX}")


@contextlib.contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path to write a file or a directory at; when the block ends without
    an error it replaces `path` (a directory: the old one is removed first, so the new one
    appears whole), else it is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_beside(path)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if tmp.is_dir() and path.exists():
        _remove(path)
    os.replace(tmp, path)


def write_atomically(path: str | Path, data: str | bytes) -> None:
    """`path` holds `data` or what it held before, never part of it."""
    with replaced_atomically(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)


def partial_writes(folder: str | Path) -> list[Path]:
    """What writes into `folder` cut short by a crash left behind."""
    return sorted(Path(folder).glob(f".*{_SUFFIX}"))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
