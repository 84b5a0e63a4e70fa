"""Ends the process groups of command agents once the process that started them is gone.

As trainers/ray_reaper.py does for a private Ray cluster: `servers.agent_processes` starts this
(stdlib only, `python -I process_reaper.py`) with a pipe on stdin whose other end only that
process holds, and writes `+PGID` when it starts an agent in a process group of its own and
`-PGID` when that group has ended. When the process ends in any way (a normal exit, a crash,
SIGKILL) the pipe reads EOF, and every group still registered is sent SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys
import time

GRACE_S = 2.0


def alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # not ours (the id was reused): never a target
        return False
    return True


def reap(groups: set[int], grace_s: float = GRACE_S) -> int:
    """SIGTERM the groups, SIGKILL those left after `grace_s`; how many were alive."""
    targets = {g for g in groups if alive(g)}
    for pgid in targets:
        _kill(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(g) for g in targets):
        time.sleep(0.05)
    for pgid in targets:
        if alive(pgid):
            _kill(pgid, signal.SIGKILL)
    return len(targets)


def _kill(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except OSError:
        pass


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # A terminal's Ctrl-C is for the command.
    groups: set[int] = set()
    for line in sys.stdin.buffer:  # Ends once the command is gone.
        text = line.strip()
        if text[:1] == b"+" and text[1:].isdigit():
            groups.add(int(text[1:]))
        elif text[:1] == b"-" and text[1:].isdigit():
            groups.discard(int(text[1:]))
    reap(groups)


if __name__ == "__main__":
    main()
