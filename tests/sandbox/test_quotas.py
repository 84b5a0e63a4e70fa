"""#34 item 7: a sandbox cannot use up a per-user kernel quota that its neighbours need.

The kernel charges inotify instances and pending signals (each POSIX timer holds one) to the
*host* uid, through every user namespace in between, so a fresh user namespace per sandbox does
not separate them. Measured before the fix (Linux 6.18): a session holding 127 inotify
instances made a neighbour's `inotify_init1` fail with EMFILE, and one holding 96,362 timers
made a neighbour's `timer_create` fail with EAGAIN.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from agentrl.sandbox import Sandbox, identity
from agentrl.sandbox.command import MAX_PENDING_SIGNALS
from agentrl.sandbox.seccomp import build_filter
from agentrl.sandbox.session import Session

from ._helpers import FAST, assert_contained


@pytest.fixture(autouse=True)
def contained(sb: Sandbox) -> Iterator[None]:
    yield
    assert_contained(sb)


_LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
_NEW = {
    "inotify": "libc.inotify_init1(0) >= 0",
    # CLOCK_MONOTONIC, default notification; never armed, so it never fires.
    "posix_timer": "libc.timer_create(1, None, ctypes.byref(ctypes.c_void_p())) == 0",
}
# Takes instances until the kernel refuses, keeps them (the session lives on), prints the count.
HOLD = {name: (_LIBC + "held = 0\nwhile held < 200_000 and " + new + ":\n    held += 1\n"
               "print(held, ctypes.get_errno())") for name, new in _NEW.items()}
PROBE = {name: (_LIBC + "ctypes.set_errno(0)\nprint('ok' if " + new +
                " else f'failed, errno {ctypes.get_errno()}')") for name, new in _NEW.items()}


@pytest.mark.parametrize("quota", sorted(_NEW))
def test_a_sandbox_holding_a_quota_does_not_starve_its_neighbours(sb: Sandbox,
                                                                  quota: str) -> None:
    with sb.session() as hog, sb.session() as neighbour:
        assert neighbour.run("1").stdout == "1\n"  # running before the hog fills its quota
        held = hog.run(HOLD[quota], timeout_s=30)
        assert held.status == "ok" and int(held.stdout.split()[0]) > 0, held
        assert neighbour.run(PROBE[quota]).stdout == "ok\n", held.stdout
        assert sb.run(PROBE[quota]).stdout == "ok\n", held.stdout  # one started meanwhile
        assert hog.alive


def test_pending_signals_are_capped_per_sandbox(sb: Sandbox) -> None:
    """RLIMIT_SIGPENDING is counted per (user namespace, uid), so the cap set inside the
    sandbox bounds each sandbox alone: where sandboxes share a uid (an unprivileged caller)
    one of them can take at most this many of the uid's ~96k."""
    with sb.session() as hog:
        held = hog.run(HOLD["posix_timer"], timeout_s=30)
        count, errno = map(int, held.stdout.split())
        # A few pending signals of the sandbox's own (a child's SIGCHLD) may share the count.
        assert MAX_PENDING_SIGNALS - 4 <= count <= MAX_PENDING_SIGNALS, held
        assert errno == 11, held  # EAGAIN


def test_without_uids_of_their_own_sandboxes_get_no_inotify(sb: Sandbox) -> None:
    """An unprivileged caller's sandboxes all run as the caller's uid, whose 128 inotify
    instances (and fanotify groups) no per-sandbox limit can divide: there those calls are
    denied, so no sandbox can take the caller's (or a neighbour's) instances."""
    if not sb.layers["seccomp"]:
        pytest.skip("the seccomp layer is inactive on this architecture")
    plan = dataclasses.replace(sb._plan, seccomp=build_filter(shared_uid=True))
    # fanotify in FID mode (0x200) is open to unprivileged users since Linux 5.13.
    with Session(sb.config, plan) as s:
        r = s.run(_LIBC + "ctypes.set_errno(0)\n"
                  "for name, call in [('inotify_init1', lambda: libc.inotify_init1(0)),\n"
                  "                   ('inotify_init', libc.inotify_init),\n"
                  "                   ('fanotify_init', lambda: libc.fanotify_init(0x200, 0))]:\n"
                  "    print(name, call(), ctypes.get_errno())")
    assert r.stdout.split("\n")[:3] == [f"{name} -1 1" for name in
                                        ("inotify_init1", "inotify_init", "fanotify_init")], r


_HOLD_ONE = ("import sys, time\nfrom agentrl.sandbox import identity\n"
             "print(identity.acquire(range({first}, {first} + 1)), flush=True)\ntime.sleep(60)")


def test_a_uid_held_by_another_process_is_not_handed_out() -> None:
    """Trainer processes on one host draw from the same range; a process that dies, however
    it dies, gives its uids back (the kernel drops its locks)."""
    first = 0x7100_0000  # Beside the range the tests' sandboxes use.
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_ONE.format(first=first)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == f"{first}\n"
        taken = [identity.acquire(range(first, first + 2))]
        with pytest.raises(identity.NoFreeUidError, match="raise SandboxConfig.num_sandbox"):
            identity.acquire(range(first, first + 2))
        assert taken == [first + 1]
    finally:
        holder.kill()
        holder.wait()
    taken.append(identity.acquire(range(first, first + 2)))
    assert taken == [first + 1, first]
    for uid in taken:
        identity.release(uid)


def test_sandboxes_beyond_the_range_are_sandbox_errors(bwrap_present: None) -> None:
    if os.geteuid() != 0:
        pytest.skip("sandboxes run as uids of their own only when the caller is root")
    sb = Sandbox(FAST.replace(sandbox_uid=0x7200_0000, num_sandbox_uids=1))
    with sb.session() as s:
        assert s.run("import os\nos.getuid()").stdout == f"{0x7200_0000}\n"
        r = sb.run("print(1)")
        assert r.status == "sandbox_error" and "all 1 sandbox uids" in r.stderr, r
    assert sb.run("print(1)").stdout == "1\n"  # the session's uid came back at its close
