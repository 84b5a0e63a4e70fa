"""Ends what is left of a private Ray cluster once the command that started it is gone.

`init_ray` starts this (stdlib only, `python -I ray_reaper.py TEMP_DIR PID`) right after it starts
a private cluster, with a pipe on stdin whose other end only the command holds. When the
command ends in any way (a normal exit, a crash, SIGKILL) the pipe reads EOF, and every process
of that cluster still alive is sent SIGTERM, then SIGKILL. Ray's own fate sharing takes down the
GCS and the raylet with the driver, but its dashboard and runtime-env agents poll for a minute
before they notice, and workers may hang on. They are found by the cluster's private temp dir:
in their command line (GCS, raylet, monitors) or among their open files (the agents, whose
command line Ray rewrites, keep their logs open there). The command itself (PID), which has
files open there too, is never a target: after a normal `shutdown_ray` it is still waiting for
this process to finish.
"""

from __future__ import annotations

import os
import signal
import sys
import time

GRACE_S = 2.0


def members(temp_dir: str, spare: int = -1) -> set[int]:
    """Live processes (other than this one and `spare`) of the cluster in temp_dir: named in
    their command line, or Ray-titled (`ray::...`) with files open under it (never, say, a
    user's `tail -f` of its logs)."""
    marker, real, found = temp_dir.encode(), os.path.realpath(temp_dir) + "/", set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (os.getpid(), spare):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            if marker in cmdline or (cmdline.startswith(b"ray::") and _holds_files(entry, real)):
                found.add(int(entry))
        except OSError:  # gone, or not ours to look at
            continue
    return found


def _holds_files(pid: str, under: str) -> bool:
    return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(under)
               for fd in os.listdir(f"/proc/{pid}/fd"))


def reap(temp_dir: str, spare: int = -1, grace_s: float = GRACE_S) -> int:
    """SIGTERM the cluster's processes, SIGKILL what is left after `grace_s`; how many."""
    targets = members(temp_dir, spare)
    for pid in targets:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and members(temp_dir, spare):
        time.sleep(0.05)
    for pid in members(temp_dir, spare):
        _kill(pid, signal.SIGKILL)
        targets.add(pid)
    return len(targets)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def main() -> None:
    temp_dir, command = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # A terminal's Ctrl-C is for the command.
    while sys.stdin.buffer.read(4096):  # Returns b"" once the command is gone.
        pass
    reap(temp_dir, spare=command)


if __name__ == "__main__":
    main()
