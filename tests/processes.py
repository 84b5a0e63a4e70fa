"""Process checks the tests of things that start processes share: whether a pid is alive, and
which of some pids are still alive after a wait."""

from __future__ import annotations

import time
from pathlib import Path


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie has ended; only its parent's wait is
    missing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def still_alive(pids: list[int], within_s: float) -> list[int]:
    """The pids still alive after waiting up to `within_s` for all of them to end."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
