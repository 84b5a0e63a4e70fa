"""A persistent, sandboxed Python session for one episode (math-tir's tool calls).

The guest interpreter (`guest.py`) runs inside the same layers as a one-shot run and keeps one
namespace across calls. A call that times out, floods output, runs out of memory or kills the
interpreter ends that interpreter (the whole sandbox, threads and subprocesses included); the
next call starts a fresh one and its result says so. Creating a Session spawns nothing, so
it is cheap and safe from many threads; the sandbox starts on the first call.
"""

from __future__ import annotations

import json
import struct
import threading
import time
import weakref
from types import TracebackType
from typing import Self

from agentrl.sandbox.command import Plan
from agentrl.sandbox.config import ExecResult, SandboxConfig, Status
from agentrl.sandbox.launch import StartError, classify, decode, start
from agentrl.sandbox.process import Child

_HEADER = struct.Struct("!Qd")  # Must match guest.py.
_DRAIN_S = 0.05
_NOTE = ("[agentrl.sandbox] the previous interpreter of this session ended ({why}); this call "
         "ran in a fresh one: earlier variables and imports are gone.\n")


class _Holder:
    """The live guest, kept apart from Session so weakref.finalize can kill it on GC/exit."""

    def __init__(self) -> None:
        self.child: Child | None = None

    def close(self) -> None:
        child, self.child = self.child, None
        if child is not None:
            child.close()


class Session:
    """`run` code in one namespace across calls; `close` (or `with`) kills everything."""

    def __init__(self, config: SandboxConfig, plan: Plan,
                 slots: threading.BoundedSemaphore | None = None) -> None:
        self._cfg, self._plan = config, plan
        self._slots = slots or threading.BoundedSemaphore(1)
        self._lock = threading.Lock()
        self._holder = _Holder()
        self._finalizer = weakref.finalize(self, self._holder.close)
        self._lost: str | None = None
        self._closed = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """An interpreter is running (False before the first call and after a crash)."""
        return self._holder.child is not None

    def close(self) -> None:
        """Kill the interpreter and everything it started; the session cannot be reused."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def run(self, code: str, timeout_s: float | None = None) -> ExecResult:
        """Execute `code` in the session's namespace; a trailing expression's repr is printed."""
        timeout = self._cfg.timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        with self._lock, self._slots:
            if self._closed:
                raise RuntimeError("Session.run after close(); open a new one with "
                                   "Sandbox.session()")
            clock = time.monotonic()
            note, restarted = "", False
            if self._holder.child is not None and self._holder.child.proc.poll() is not None:
                self._holder.close()  # Died between calls (a background thread's doing).
                self._lost = "it ended between calls"
            if self._holder.child is None:
                try:
                    self._holder.child = start(self._cfg, self._plan, code=None, cpu_time_s=None)
                except StartError as exc:
                    return ExecResult("sandbox_error", None, "", f"agentrl.sandbox: {exc}\n",
                                      time.monotonic() - clock)
                if self._lost is not None:
                    note, restarted = _NOTE.format(why=self._lost), True
                    self._lost = None
            try:
                result = self._call(self._holder.child, code, clock + timeout, clock)
            except BaseException:  # Never leave a half-used interpreter behind.
                self._holder.close()
                self._lost = "the host side failed"
                raise
            if restarted:
                result = ExecResult(result.status, result.returncode, result.stdout,
                                    note + result.stderr, result.wall_s, result.truncated,
                                    session_restarted=True)
            return result

    def _call(self, child: Child, code: str, deadline: float, clock: float) -> ExecResult:
        data = code.encode("utf-8", "surrogatepass")
        child.send(_HEADER.pack(len(data), self._cfg.cpu_time_s or 0.0) + data)
        oom_before = child.cgroup.oom_kills() if child.cgroup is not None else 0
        event = child.pump(deadline, want_message=True)
        if event == "message":
            child.drain(_DRAIN_S)
            if not child.overflow:
                return self._finished(child, oom_before, clock)
            event = "overflow"
        # The interpreter is gone or must go: timeout, flood, OOM kill or a crash.
        self._holder.child = None
        child.close()
        stdout, stderr, truncated = child.take_output()
        status, rc = classify(child, event, oom_before)
        self._lost = f"status {status}" if status != "ok" else "the code exited it"
        return ExecResult(status, rc, decode(stdout), decode(stderr), time.monotonic() - clock,
                          truncated)

    def _finished(self, child: Child, oom_before: int, clock: float) -> ExecResult:
        """A call the guest completed: its own exit-like code decides the status."""
        line = child.take_message() or b"{}"
        try:
            reply = json.loads(line)
            rc, exc = int(reply["rc"]), reply.get("exc")
        except (ValueError, KeyError, TypeError):  # The code scribbled on the protocol pipe.
            rc, exc = 1, None
        stdout, stderr, truncated = child.take_output()
        status: Status = "ok" if rc == 0 else "error"
        oom_now = child.cgroup.oom_kills() if child.cgroup is not None else 0
        if rc != 0 and (exc == "MemoryError" or oom_now > oom_before):
            status = "oom"
        return ExecResult(status, rc, decode(stdout), decode(stderr), time.monotonic() - clock,
                          truncated)
