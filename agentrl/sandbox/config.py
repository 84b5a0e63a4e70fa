"""Configuration, result type and error of the sandbox (stdlib only).

Kept apart from the process machinery so the math-tir env (and its fakes in tests) can build
configs and results without spawning anything.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["ok", "error", "timeout", "oom", "output_limit", "killed", "sandbox_error"]
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "oom", "output_limit", "killed",
                             "sandbox_error")

ALLOW_UNISOLATED_ENV = "AGENTRL_SANDBOX_ALLOW_UNISOLATED"


class SandboxUnavailableError(RuntimeError):
    """Isolation cannot be set up here; raised instead of silently running unisolated."""


_FLOORS: dict[str, tuple[int, str]] = {
    "max_processes": (4, " (the interpreter and the sandbox's init count)"),
    "max_open_files": (16, " (python needs a few)"),
    "memory_mb": (32, " (python needs ~10 MB)"),
    "num_sandbox_uids": (1, ""),
}
"""The least a `SandboxConfig` field may be, and why (said in the error)."""


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits for one execution (a one-shot run, or one call of a session)."""

    timeout_s: float = 5.0
    """Wall-clock seconds per run/call, start-up included; wall, not CPU, so `sleep` ends too."""
    memory_mb: int = 512
    """Memory cap: cgroup `memory.max` where writable, else the address-space rlimit."""
    max_processes: int = 64
    """Processes+threads per sandbox (RLIMIT_NPROC in the sandbox's user namespace, cgroup pids)."""
    max_output_bytes: int = 65536
    """Per stream (stdout, stderr) per run; more kills the run with status `output_limit`."""
    max_file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE)."""
    cpu_time_s: float | None = None
    """CPU seconds per run/call (RLIMIT_CPU); None: only the wall timeout bounds CPU."""
    disk_mb: int = 64
    """Size of each writable tmpfs (/tmp, the work dir, /dev/shm); charged to memory, not disk."""
    cpu_cores: float | None = 1.0
    """CPU quota in cores (cgroup cpu controller where writable) so spinning threads cannot
    starve the trainer; None: no quota."""
    max_open_files: int = 256
    """RLIMIT_NOFILE, so fd exhaustion stays inside the sandbox."""
    bwrap_path: str = "bwrap"
    """bubblewrap executable (name on PATH or absolute path)."""
    python_path: str | None = None
    """Interpreter run inside the sandbox; it must live under /usr or `extra_ro_paths`. None:
    /usr/bin/python3, else this process's base interpreter if it lives under /usr."""
    extra_ro_paths: tuple[str, ...] = ()
    """Host paths bound read-only at the same place; they must be readable by any uid (the
    sandbox's is one of `sandbox_uid`'s range; not under a 0700 /root). To let the code import
    a venv's packages (sympy, numpy): python_path=<venv>/bin/python,
    extra_ro_paths=(<venv>, <its base prefix>)."""
    sandbox_uid: int = 0x7000_0000
    """First of the unprivileged host uids sandboxes run as when the caller is root, one of its
    own per live sandbox (so per-user kernel quotas are not shared, #34 item 7). The default
    range is one systemd leaves unallocated (above its container ranges); no file or process
    of the host should belong to these uids."""
    num_sandbox_uids: int = 65536
    """How many uids from `sandbox_uid` on; also the most sandboxes (one-shot runs and open
    sessions) alive at once on this host when the caller is root."""
    max_concurrent: int | None = None
    """Executions (one-shot runs and session calls) running at once per Sandbox; more wait,
    and the wait is not charged to their timeout. None: 2 x CPU cores, at least 4."""
    seccomp: bool = True
    """Install the seccomp deny-list (x86_64 only; elsewhere this layer is skipped)."""

    def __post_init__(self) -> None:
        positive = {
            "timeout_s": self.timeout_s, "memory_mb": self.memory_mb,
            "max_processes": self.max_processes, "max_output_bytes": self.max_output_bytes,
            "max_file_mb": self.max_file_mb, "disk_mb": self.disk_mb,
            "max_open_files": self.max_open_files,
        }
        for name, value in positive.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"SandboxConfig.{name} must be a positive finite number, "
                                 f"got {value!r}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"SandboxConfig.max_concurrent must be None or >= 1, got "
                             f"{self.max_concurrent}")
        for name in ("cpu_time_s", "cpu_cores"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise ValueError(f"SandboxConfig.{name} must be None or a positive number, "
                                 f"got {value!r}")
        for name, (floor, why) in _FLOORS.items():
            value = getattr(self, name)
            if value < floor:
                raise ValueError(f"SandboxConfig.{name} must be >= {floor}{why}, got {value}")
        if not 0 < self.sandbox_uid <= 2**32 - 1 - self.num_sandbox_uids:
            raise ValueError(f"SandboxConfig.sandbox_uid must be an unprivileged uid with "
                             f"num_sandbox_uids={self.num_sandbox_uids} uids after it below "
                             f"2**32 - 1, got {self.sandbox_uid}")
        if self.python_path is not None and not self.python_path.startswith("/"):
            raise ValueError(f"SandboxConfig.python_path must be absolute, got "
                             f"{self.python_path!r}")
        for path in self.extra_ro_paths:
            if not path.startswith("/") or path.rstrip("/") in ("", "/proc", "/dev", "/tmp"):
                raise ValueError(f"SandboxConfig.extra_ro_paths entries must be absolute host "
                                 f"paths other than / /proc /dev /tmp, got {path!r}")

    def replace(self, **changes: Any) -> SandboxConfig:
        """A copy with some fields changed (configs are never mutated)."""
        return dataclasses.replace(self, **changes)

    def call_timeout(self, code: str, timeout_s: float | None) -> float:
        """The wall-clock limit of one run or session call: `timeout_s`, else `timeout_s` of
        the config. Checks the call's arguments (`Sandbox.run`, `Session.run`) first."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        return timeout


@dataclass(frozen=True)
class ExecResult:
    """What one run/call produced. `sandbox_error` is infrastructure failing: never score it."""

    status: Status
    """ok | error (non-zero exit or exception) | timeout (wall or CPU) | oom | output_limit |
    killed (died from a signal, e.g. SIGSEGV) | sandbox_error."""
    returncode: int | None
    """Exit code; -N for death by signal N; None when the sandbox killed it or it never ran.
    (One-shot runs learn signals from bwrap as 128+N, so `sys.exit(137)` also reads as -9.)"""
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool = False
    """Output was cut at `max_output_bytes`."""
    session_restarted: bool = field(default=False)
    """Session calls only: this call ran in a fresh interpreter because the previous one died,
    so earlier variables are gone (stderr starts with a note saying so)."""

    @property
    def ok(self) -> bool:
        """The code ran to completion with exit status 0."""
        return self.status == "ok"
