"""Start one sandbox (one-shot program or session guest) and turn its end into an ExecResult.

Code travels in a memfd that bwrap copies into the sandbox's tmpfs (`--file FD`): never argv
(14 MB of source would hit "Argument list too long") and never a host directory that could fill
the disk or be left behind.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from agentrl.sandbox import identity
from agentrl.sandbox.cgroup import Cgroup, CgroupFactory
from agentrl.sandbox.command import (
    CODE_NAME,
    NOTICE,
    WORK_DIR,
    Plan,
    bwrap_args,
    isolated_env,
    isolated_outer_args,
    proc_masks,
    rlimit_args,
    unisolated_env,
    unisolated_outer_args,
)
from agentrl.sandbox.config import ExecResult, SandboxConfig, Status
from agentrl.sandbox.process import Child, PumpEvent, spawn

GUEST_SOURCE = (Path(__file__).parent / "guest.py").read_text()
_MB = 1 << 20
_factory_lock = threading.Lock()
_factory: list[CgroupFactory | None] = []


class StartError(RuntimeError):
    """The sandbox could not be started (infrastructure, not the code)."""


def cgroup_factory() -> CgroupFactory | None:
    """Detect a writable cgroup hierarchy once per process (and sweep dead callers' groups)."""
    with _factory_lock:
        if not _factory:
            factory = CgroupFactory.detect()
            if factory is not None:
                factory.collect_stale()
            _factory.append(factory)
        return _factory[0]


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view, written = memoryview(data), 0
    while written < len(data):  # os.write may write less than asked for large buffers.
        written += os.write(fd, view[written:])
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def start(cfg: SandboxConfig, plan: Plan, *, code: bytes | None,
          cpu_time_s: float | None) -> Child:
    """Launch `code` as a one-shot program, or the session guest when `code` is None."""
    uid: int | None = None
    if plan.uids is not None:
        try:
            uid = identity.acquire(plan.uids)
        except identity.NoFreeUidError as exc:
            raise StartError(str(exc)) from exc
    cgroup: Cgroup | None = None
    factory = cgroup_factory() if plan.has_cgroup else None
    parent_fds: list[int] = []  # Child-side ends, closed here once the child has them.
    status_r = -1
    try:
        if factory is not None:
            try:
                cgroup = factory.create(cfg.memory_mb * _MB, cfg.max_processes, cfg.cpu_cores)
            except OSError as exc:
                raise StartError(f"cannot create the execution's cgroup: {exc}") from exc
        status_r, status_w = os.pipe()
        parent_fds.append(status_w)
        return _start(cfg, plan, code, cpu_time_s, cgroup, uid, status_r, status_w, parent_fds)
    except BaseException:  # Nothing started: undo what was set up for it.
        if status_r >= 0:
            os.close(status_r)
        if cgroup is not None:
            cgroup.kill()
            cgroup.remove()
        if uid is not None:
            identity.release(uid)
        raise
    finally:
        for fd in parent_fds:
            os.close(fd)


def _start(cfg: SandboxConfig, plan: Plan, code: bytes | None, cpu_time_s: float | None,
           cgroup: Cgroup | None, uid: int | None, status_r: int, status_w: int,
           parent_fds: list[int]) -> Child:
    isolated = plan.bwrap is not None
    python = [plan.python, "-I", "-u"]
    msg_r = ctl_w = None
    if code is None:  # Session guest: code in on a control pipe, replies on a message pipe.
        msg_r, msg_w = os.pipe()
        ctl_r, ctl_w = os.pipe()
        parent_fds += [msg_w, ctl_r]
        python += ["-c", GUEST_SOURCE, str(ctl_r), str(msg_w)]
    procs = cgroup.procs_files if cgroup is not None else []
    # Outside a user namespace RLIMIT_NPROC and RLIMIT_SIGPENDING count every process of the
    # uid on the host (the caller's, when it is not root), so the unisolated tier sets them
    # only for a uid of the sandbox's own, and RLIMIT_NPROC only if no pids cgroup bounds it.
    pids_cgroup = cgroup is not None and "pids" in cgroup.controllers
    rlimits = rlimit_args(cfg, cpu_time_s=cpu_time_s,
                          nproc=isolated or (uid is not None and not pids_cgroup),
                          sigpending=isolated or uid is not None, has_cgroup=cgroup is not None)
    work_dir = gate_w = None
    if isolated:
        gate_r = None
        if cgroup is not None:  # Child.admit joins the cgroup, then opens the gate.
            gate_r, gate_w = os.pipe()
            parent_fds.append(gate_r)
        argv = [*_isolated_argv(cfg, plan, code, uid, status_w, gate_r, parent_fds), *rlimits]
        env, cwd = isolated_env(), None
        if code is not None:
            python.append(f"{WORK_DIR}/{CODE_NAME}")
    else:
        work_dir = tempfile.mkdtemp(prefix="agentrl-sandbox-")
        if code is not None:
            Path(work_dir, CODE_NAME).write_bytes(code)
            python.append(os.path.join(work_dir, CODE_NAME))
        if uid is not None:
            os.chown(work_dir, uid, uid)
        argv = [*unisolated_outer_args(procs, uid), *rlimits]
        env, cwd = unisolated_env(work_dir), work_dir
    try:  # stdin is the status pipe until NOTICE swaps in /dev/null.
        proc = spawn([*argv, *NOTICE, *python], env=env, stdin=status_w,
                     pass_fds=tuple(parent_fds), cwd=cwd)
    except OSError as exc:
        if gate_w is not None:
            os.close(gate_w)
        raise StartError(f"cannot start {argv[0]}: {exc}") from exc
    return Child(proc, cap=cfg.max_output_bytes, isolated=isolated, status_r=status_r,
                 msg_r=msg_r, stdin_w=ctl_w, cgroup=cgroup, work_dir=work_dir, gate_w=gate_w,
                 uid=uid)


def _isolated_argv(cfg: SandboxConfig, plan: Plan, code: bytes | None, uid: int | None,
                   status_w: int, gate_r: int | None, parent_fds: list[int]) -> list[str]:
    """unshare (when root) and bwrap, with the memfds bwrap reads added to `parent_fds`."""
    code_fd = None if code is None else _memfd("agentrl-code", code)
    seccomp_fd = None if plan.seccomp is None else _memfd("agentrl-seccomp", plan.seccomp)
    mask_fds = {path: _memfd("agentrl-mask", content) for path, content in proc_masks().items()}
    parent_fds += [fd for fd in (code_fd, seccomp_fd, *mask_fds.values()) if fd is not None]
    return [*isolated_outer_args(plan, uid),
            *bwrap_args(cfg, plan, status_fd=status_w, seccomp_fd=seccomp_fd, code_fd=code_fd,
                        code_bytes=len(code or b""), gate_fd=gate_r, mask_fds=mask_fds)]


def exit_status(child: Child) -> tuple[Status, int | None]:
    """Status and returncode of a program that ended by itself (after `child.close()`)."""
    rc = child.proc.returncode
    if child.isolated and 128 < rc <= 128 + 64:
        rc = 128 - rc  # bwrap reports death by signal N as exit code 128+N.
    if rc == 0:
        return "ok", 0
    if rc < 0:
        return ("timeout" if -rc == signal.SIGXCPU else "killed"), rc
    return "error", rc


def looks_oom(stderr: bytes) -> bool:
    """Python's own MemoryError (the address-space backstop hit before the cgroup limit)."""
    lines = stderr.rstrip().splitlines()
    return bool(lines) and lines[-1].startswith(b"MemoryError")


def decode(data: bytes) -> str:
    """Model output is arbitrary bytes: invalid UTF-8 is replaced, NULs are kept."""
    return data.decode("utf-8", errors="replace")


def said(status: Status, stderr: bytes) -> bytes:
    """A run's stderr, with the reason a sandbox_error that printed nothing failed (one-shot
    runs and session calls alike: a log line or observation never shows an empty cause)."""
    if status == "sandbox_error" and not stderr:
        return b"agentrl.sandbox: the sandbox failed to start or to clean up\n"
    return stderr


def classify(child: Child, event: PumpEvent, oom_before: int = 0) -> tuple[Status, int | None]:
    """The status of an execution that ended with `event`; call after `child.close()`."""
    if not child.started or child.leaked:
        return "sandbox_error", None
    if event == "overflow":
        return "output_limit", None
    if event == "timeout":
        return "timeout", None
    status, rc = exit_status(child)
    if status != "ok" and child.oom_kills > oom_before:
        return "oom", rc
    return status, rc


def run_once(cfg: SandboxConfig, plan: Plan, code: str, timeout_s: float,
             clock: float) -> ExecResult:
    """One fresh interpreter for `code`, always fully cleaned up before returning."""
    try:
        child = start(cfg, plan, code=code.encode("utf-8", "surrogatepass"),
                      cpu_time_s=cfg.cpu_time_s)
    except StartError as exc:
        return ExecResult("sandbox_error", None, "", f"agentrl.sandbox: {exc}\n",
                          time.monotonic() - clock)
    try:
        event = child.pump(clock + timeout_s)
    finally:
        child.close()
    stdout, stderr, truncated = child.take_output()
    status, rc = classify(child, event)
    if status in ("error", "killed") and looks_oom(stderr):
        status = "oom"
    return ExecResult(status, rc, decode(stdout), decode(said(status, stderr)),
                      time.monotonic() - clock, truncated)
