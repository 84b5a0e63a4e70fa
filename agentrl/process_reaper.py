"""Ends what a command started once the command is gone, whichever way it ends (a normal exit,
a crash, SIGKILL): the one reaper of the processes agentrl starts outside its own tree.

The command starts this file (stdlib only: `python -I process_reaper.py MODE ...`, in a session
of its own so that a terminal's Ctrl-C reaches only the command) with a pipe on stdin whose
other end only the command holds. When the pipe reads EOF, every target still alive is sent
SIGTERM, then SIGKILL after a grace period. Two kinds of targets:

- `groups`: process groups the command registers on the pipe, `+PGID` when it starts one and
  `-PGID` once it has ended (`group_reaper()` below: `servers.agent_processes`' command agents
  and `environments.miniwob`'s browsers, each in a process group of its own). A group that is
  not ours (its id reused by another user) is never a target. This reaper runs detached (no
  child of the command), so that what ends a dead command's children cannot end it first.
- `ray TEMP_DIR PID`: a private Ray cluster's processes (`trainers.ray_utils.init_ray`). Ray's
  fate sharing takes the GCS and the raylet down with the driver, but its dashboard and
  runtime-env agents poll for a minute before they notice, and workers may hang on. They are
  found by the cluster's private temp dir: in their command line (GCS, raylet, monitors) or
  among their open files (the agents, whose command line Ray rewrites, keep their logs open
  there). The command (PID), which has files open there too, is never a target: after a normal
  `shutdown_ray` it is still waiting for this process to finish.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

GRACE_S = 2.0


def terminate(targets: Callable[[], set[int]], kill: Callable[[int, int], None],
              grace_s: float = GRACE_S) -> int:
    """`kill(target, SIGTERM)` each of `targets()`, then SIGKILL those still listed after
    `grace_s`; how many were targeted."""
    first = targets()
    for target in first:
        kill(target, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and targets():
        time.sleep(0.05)
    left = targets()
    for target in left:
        kill(target, signal.SIGKILL)
    return len(first | left)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or not ours: never a target
        return False
    return True


def reap_groups(groups: set[int], grace_s: float = GRACE_S) -> int:
    """End the process groups that are still alive; how many were."""
    return terminate(lambda: {g for g in groups if group_alive(g)}, _signal(os.killpg), grace_s)


def ray_members(temp_dir: str, spare: int = -1) -> set[int]:
    """Live processes (other than this one and `spare`) of the Ray cluster in temp_dir: named
    in their command line, or Ray-titled (`ray::...`) with files open under it (never, say, a
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


def reap_ray(temp_dir: str, spare: int = -1, grace_s: float = GRACE_S) -> int:
    """End the Ray cluster's processes; how many there were."""
    return terminate(lambda: ray_members(temp_dir, spare), _signal(os.kill), grace_s)


def _holds_files(pid: str, under: str) -> bool:
    return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(under)
               for fd in os.listdir(f"/proc/{pid}/fd"))


def _signal(send: Callable[[int, int], None]) -> Callable[[int, int], None]:
    def kill(target: int, signum: int) -> None:
        try:
            send(target, signum)
        except OSError:
            pass

    return kill


class GroupReaper:
    """The command's side of a `groups` reaper: started in a session of its own, told of each
    process group the command starts (`watch`) and ends (`forget`).

    The reaper is detached: its starter forks it and exits, so it is no child of the command.
    Whatever ends a dead command's children (Ray's raylet does, for a worker that died with
    its driver) then cannot end the reaper before it has reaped."""

    def __init__(self) -> None:
        starter = subprocess.Popen([sys.executable, "-I", __file__, "groups", "--detach"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   start_new_session=True)
        assert starter.stdin is not None and starter.stdout is not None
        try:
            self.pid = int(starter.stdout.readline())
        except ValueError:
            starter.kill()
            raise RuntimeError("the process reaper did not start") from None
        finally:
            starter.stdout.close()
            starter.wait()
        self.stdin = starter.stdin
        self.lock = threading.Lock()
        self.owner = os.getpid()  # a forked child starts its own

    def alive(self) -> bool:
        """Whether the reaper runs (its pid is a live process_reaper, not a reused pid)."""
        try:
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                if os.path.basename(__file__).encode() not in f.read():
                    return False
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    def _send(self, line: str) -> None:
        with self.lock, contextlib.suppress(OSError):
            self.stdin.write(line.encode())
            self.stdin.flush()

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")


_group_reaper: GroupReaper | None = None
_group_reaper_lock = threading.Lock()


def group_reaper() -> GroupReaper:
    """This process's reaper of process groups, started on first use (and again if it died)."""
    global _group_reaper
    with _group_reaper_lock:
        r = _group_reaper
        if r is None or r.owner != os.getpid() or not r.alive():
            r = _group_reaper = GroupReaper()
        return r


def stop_group_reaper(timeout_s: float = 10.0) -> None:
    """End this process's reaper of process groups now, as if the command had exited: it ends
    the groups still registered and exits. The next `group_reaper()` starts a fresh one."""
    global _group_reaper
    with _group_reaper_lock:
        r, _group_reaper = _group_reaper, None
    if r is None or r.owner != os.getpid():
        return
    with r.lock, contextlib.suppress(OSError):
        r.stdin.close()
    deadline = time.monotonic() + timeout_s
    while r.alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if r.alive():
        with contextlib.suppress(OSError):
            os.kill(r.pid, signal.SIGKILL)


def kill_group(pgid: int) -> None:
    """SIGKILL a process group; nothing if it is gone already."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # A terminal's Ctrl-C is for the command.
    if argv[:1] == ["ray"]:
        temp_dir, command = argv[1], int(argv[2])
        while sys.stdin.buffer.read(4096):  # Returns b"" once the command is gone.
            pass
        reap_ray(temp_dir, spare=command)
        return
    if argv[:1] != ["groups"]:
        raise SystemExit(f"usage: {sys.argv[0]} groups [--detach] | ray TEMP_DIR PID")
    if "--detach" in argv[1:]:  # fork the reaper, say its pid, and leave it (GroupReaper)
        pid = os.fork()
        if pid:
            sys.stdout.write(f"{pid}\n")
            sys.stdout.flush()
            os._exit(0)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the starter's pipe: nobody reads it now
    groups: set[int] = set()
    for line in sys.stdin.buffer:  # Ends once the command is gone.
        text = line.strip()
        if text[:1] == b"+" and text[1:].isdigit():
            groups.add(int(text[1:]))
        elif text[:1] == b"-" and text[1:].isdigit():
            groups.discard(int(text[1:]))
    reap_groups(groups)


if __name__ == "__main__":
    main(sys.argv[1:])
