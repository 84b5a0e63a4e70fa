"""Build the exec chain of one sandbox (no preexec_fn: it is not thread-safe).

Isolated tier, outer to inner, each stage an exec wrapper:

    unshare (caller is root: a time namespace whose clocks start at zero, then drop to the
    sandbox's own uid) -> bwrap (namespaces, no-new-privs, read-only /usr, tmpfs /tmp /work
    /dev/shm, host facts of /proc masked, clearenv, seccomp; waits on --block-fd while the caller
    moves it into the cgroup) -> prlimit (rlimits) -> sh (NOTICE: "started", stdin /dev/null)
    -> python3 -I -u

Measured on the 2-core CI machine, the wrappers cost nothing visible next to bwrap's own
namespace set-up and the interpreter's start (see benchmarks/results/sandbox_overhead.md).

prlimit runs *inside* the user namespace on purpose: since Linux 5.14 RLIMIT_NPROC is counted
per (user namespace, uid), so a limit set there bounds this sandbox alone, and a fork bomb in
one sandbox cannot starve a neighbour running as the same uid (set outside, it would count every
process of that uid on the host).

The same rlimits cap pending signals (RLIMIT_SIGPENDING, also per (user namespace, uid)): each
POSIX timer holds one, so where sandboxes share a host uid (an unprivileged caller) one of them
can hold at most MAX_PENDING_SIGNALS of the uid's ~96k, not all of them (#34 item 7).

Host facts of /proc are replaced by bwrap's --ro-bind-data (#34 item 11): /proc/cmdline (the
host's boot parameters) reads empty, the boot id is random per sandbox, /proc/uptime reads
"0.00 0.00". The uptime is also in the boot-relative clocks (CLOCK_BOOTTIME, CLOCK_MONOTONIC,
a process's start time in /proc/PID/stat): where the caller is root the sandbox gets a time
namespace whose offsets start those clocks at zero; bubblewrap cannot make one unprivileged.

Unisolated tier (explicit opt-in only): sh (joins the cgroup as root, there is no bwrap gate)
-> setpriv -> prlimit -> sh (NOTICE) -> python, in a fresh 0700 directory.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass

from agentrl.sandbox.config import SandboxConfig

WORK_DIR = "/work"
CODE_NAME = "main.py"
_MB = 1 << 20
# The sandbox has no /etc and no HOME on the host: a small explicit environment only.
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# `sh` joins the cgroup with its own pid before exec'ing the rest (as root, before setpriv).
_JOIN = ('while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; '
         'exec "$@"')
# The last stage before python, inside every other layer: report "started" on fd 0 (the
# status pipe), then give python /dev/null as stdin. bwrap reports its child's pid before it
# sets up the mounts, so only this notice tells "the code ran and failed" (error) from "the
# sandbox never came up" (sandbox_error); code cannot un-send it, and cannot send it early.
_NOTICE = 'echo started >&0 && exec "$@" </dev/null'
NOTICE = ["/bin/sh", "-c", _NOTICE, "sh"]
# With a cgroup the address-space rlimit is only a coarse backstop: thread stacks and
# allocator arenas reserve far more virtual memory than they touch.
_AS_BACKSTOP_FACTOR = 4
MAX_PENDING_SIGNALS = 1024
"""RLIMIT_SIGPENDING per sandbox: queued signals and POSIX timers (python itself uses none)."""


@dataclass(frozen=True)
class Plan:
    """What works on this machine, decided once per config by `sandbox._plan_for`."""

    bwrap: str | None
    """Resolved bubblewrap path; None only in the opted-in unisolated tier."""
    python: str
    """Interpreter the code runs under."""
    uids: range | None
    """Host uids to run sandboxes as, a different one for each live sandbox (caller is root,
    `identity.py`); None when already unprivileged: every sandbox runs as the caller."""
    has_cgroup: bool
    seccomp: bytes | None
    time_namespace: bool = False
    """Give each isolated sandbox a time namespace (needs root's CAP_SYS_ADMIN)."""


def resolve_bwrap(cfg: SandboxConfig) -> str | None:
    """Absolute path of bubblewrap, or None if it is not installed where the config says."""
    if "/" in cfg.bwrap_path:
        return cfg.bwrap_path if os.access(cfg.bwrap_path, os.X_OK) else None
    return shutil.which(cfg.bwrap_path)


def resolve_python(cfg: SandboxConfig) -> str | None:
    """The sandbox interpreter: the configured one, else a system python under /usr."""
    if cfg.python_path is not None:
        candidates = [cfg.python_path]
    else:  # The running interpreter may be a venv or pyenv build outside /usr: not visible.
        base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        candidates = ["/usr/bin/python3", *([base] if base.startswith("/usr/") else [])]
    for path in candidates:
        if os.access(path, os.X_OK):
            return path
    return None


def rlimit_args(cfg: SandboxConfig, *, cpu_time_s: float | None, nproc: bool,
                sigpending: bool, has_cgroup: bool) -> list[str]:
    """`prlimit ... --` for one execution; CPU soft limit sends SIGXCPU, hard one SIGKILL."""
    memory = cfg.memory_mb * _MB
    address_space = memory * _AS_BACKSTOP_FACTOR if has_cgroup else memory
    args = ["prlimit", f"--as={address_space}", f"--fsize={cfg.max_file_mb * _MB}",
            f"--nofile={cfg.max_open_files}", "--core=0"]
    if nproc:
        args.append(f"--nproc={cfg.max_processes}")
    if sigpending:
        args.append(f"--sigpending={MAX_PENDING_SIGNALS}")
    if cpu_time_s is not None:
        soft = math.ceil(cpu_time_s)
        args.append(f"--cpu={soft}:{soft + 1}")
    return [*args, "--"]


def _root_links() -> list[str]:
    """Recreate /bin /lib /lib64 /sbin as the host has them (merged-/usr links or dirs)."""
    args: list[str] = []
    for name in ("/bin", "/lib", "/lib64", "/lib32", "/libx32", "/sbin"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    return args


def proc_masks() -> dict[str, bytes]:
    """What the sandbox reads instead of the host's boot facts (fresh per sandbox)."""
    return {"/proc/cmdline": b"",
            "/proc/sys/kernel/random/boot_id": f"{uuid.uuid4()}\n".encode(),
            "/proc/uptime": b"0.00 0.00\n"}


def bwrap_args(cfg: SandboxConfig, plan: Plan, *, status_fd: int, seccomp_fd: int | None,
               code_fd: int | None, code_bytes: int, gate_fd: int | None,
               mask_fds: dict[str, int]) -> list[str]:
    """bubblewrap options: every namespace, nothing of the host but /usr (read-only); each
    of `mask_fds` (path -> fd to read its content from) replaces a file of /proc."""
    assert plan.bwrap is not None
    size = str(cfg.disk_mb * _MB)
    args = [plan.bwrap, "--unshare-all", "--unshare-user", "--disable-userns",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr", *_root_links(), "--proc", "/proc"]
    for path, fd in mask_fds.items():
        args += ["--ro-bind-data", str(fd), path]
    args += ["--dev", "/dev",
             "--size", size, "--tmpfs", "/dev/shm",
             "--size", size, "--tmpfs", "/tmp",
             # The work dir also holds the code, so it is sized to fit even a 14 MB program.
             "--size", str(cfg.disk_mb * _MB + code_bytes), "--tmpfs", WORK_DIR]
    for path in cfg.extra_ro_paths:  # After the tmpfs mounts, so /tmp/... paths stay visible.
        args += ["--ro-bind", path, path]
    if code_fd is not None:
        args += ["--perms", "0644", "--file", str(code_fd), f"{WORK_DIR}/{CODE_NAME}"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    if gate_fd is not None:  # Set-up done, the program waits here until we open the gate.
        args += ["--block-fd", str(gate_fd)]
    args += ["--chdir", WORK_DIR, "--hostname", "sandbox", "--json-status-fd", str(status_fd),
             "--clearenv"]
    for key, value in {**_ENV, "HOME": WORK_DIR, "TMPDIR": "/tmp"}.items():
        args += ["--setenv", key, value]
    return [*args, "--"]


def isolated_outer_args(plan: Plan, uid: int | None) -> list[str]:
    """The stage before bwrap when the caller is root: a time namespace whose boot-relative
    clocks read zero now, then the sandbox's own uid (and gid, no supplementary groups).
    bwrap sets no-new-privs itself."""
    if uid is None:
        return []
    args = ["unshare"]
    if plan.time_namespace:
        boottime = int(time.clock_gettime(time.CLOCK_BOOTTIME))
        args += ["--time", f"--monotonic=-{int(time.monotonic())}", f"--boottime=-{boottime}"]
    return [*args, f"--setgid={uid}", f"--setuid={uid}", "--"]


def unisolated_outer_args(procs_files: list[str], uid: int | None) -> list[str]:
    """The stages of the unisolated tier: join the cgroup (as root), then drop privileges."""
    args: list[str] = []
    if procs_files:
        args += ["/bin/sh", "-c", _JOIN, "sh", *procs_files, "--"]
    if uid is not None:
        args += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                 "--no-new-privs", "--"]
    return args


def unisolated_env(work_dir: str) -> dict[str, str]:
    """Environment of the unisolated tier: the same small set, pointing at the fresh dir."""
    return {**_ENV, "HOME": work_dir, "TMPDIR": work_dir}


def isolated_env() -> dict[str, str]:
    """Environment for the wrappers before bwrap: nothing of the trainer's (bwrap clears it)."""
    return {"PATH": _ENV["PATH"]}
