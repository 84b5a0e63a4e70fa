"""A host uid of its own for every live sandbox, when the caller is root (#34 item 7).

The kernel counts several quotas per *host* uid, and charges them through every user namespace
on the way up (kernel/ucount.c: a namespace's counts also land on its creator's uid in the
parent): inotify instances (128 by default), fanotify groups, pending signals with the POSIX
timers that hold one (RLIMIT_SIGPENDING, ~96k here), POSIX message-queue bytes and locked
shared memory. A fresh user namespace per sandbox therefore does not separate them, and when
every sandbox ran as uid 65534 one episode could starve the others: measured on Linux 6.18, a
session holding 127 inotify instances made a neighbour's `inotify_init1` fail with EMFILE, one
holding 96,362 timers made a neighbour's `timer_create` fail with EAGAIN.

So each sandbox runs as a uid nobody else uses: one of `SandboxConfig.num_sandbox_uids` uids
from `SandboxConfig.sandbox_uid` on, taken when it starts and handed back only once it is
verified empty (a sandbox that left processes behind keeps its uid). Trainer processes on one
host share the range safely: a uid is taken under a POSIX byte-range lock at offset uid of one
root-owned lock file, which the kernel drops when the holding process dies, however it dies.

An unprivileged caller has one uid to give, its own; there `seccomp.py` denies the quota calls
no per-sandbox limit can divide, and `command.MAX_PENDING_SIGNALS` caps the rest per sandbox.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import stat
import tempfile
import threading

logger = logging.getLogger(__name__)

LOCK_NAME = "agentrl-sandbox-uids.lock"
_lock = threading.Lock()
_held: set[int] = set()
"""uids this process has handed out and not yet taken back."""
_cursor: dict[range, int] = {}
_lock_file: list[int | None] = []
"""The lock file's descriptor, opened once and never closed: closing any descriptor of a file
drops every POSIX lock the process holds on it."""


class NoFreeUidError(RuntimeError):
    """Every uid of the range belongs to a live sandbox."""


def _lock_dir() -> str:
    return "/run" if os.path.isdir("/run") else tempfile.gettempdir()


def _open_lock_file() -> int | None:
    """The shared lock file, or None (uids then coordinated within this process only)."""
    path = os.path.join(_lock_dir(), LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        logger.warning("agentrl.sandbox: cannot open %s (%s); sandbox uids are unique within "
                       "this process only", path, exc)
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)  # Someone else's file: their locks could hand out our uids.
        logger.warning("agentrl.sandbox: %s is not a regular file of ours; sandbox uids are "
                       "unique within this process only", path)
        return None
    return fd


def _lock_fd() -> int | None:
    if not _lock_file:
        _lock_file.append(_open_lock_file())
    return _lock_file[0]


def _try_take(fd: int | None, uid: int) -> bool:
    if fd is None:
        return True
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, uid)
    except OSError:  # Another process's sandbox has it.
        return False
    return True


def acquire(uids: range) -> int:
    """A uid of `uids` that no live sandbox (of any process on this host) runs as."""
    with _lock:
        fd = _lock_fd()
        # Each process starts at a random place, so concurrent processes rarely meet.
        start = _cursor.get(uids, random.randrange(len(uids)))
        for step in range(len(uids)):
            index = (start + step) % len(uids)
            uid = uids[index]
            if uid not in _held and _try_take(fd, uid):
                _held.add(uid)
                _cursor[uids] = index + 1
                return uid
    raise NoFreeUidError(f"all {len(uids)} sandbox uids ({uids.start}-{uids.stop - 1}) belong "
                         f"to live sandboxes; raise SandboxConfig.num_sandbox_uids")


def release(uid: int) -> None:
    """Give back a uid whose sandbox is verified empty."""
    with _lock:
        if uid not in _held:
            return
        _held.discard(uid)
        fd = _lock_fd()
        if fd is not None:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, uid)


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's locks (and must not give back its uids)."""
    global _lock
    _lock = threading.Lock()
    _held.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
