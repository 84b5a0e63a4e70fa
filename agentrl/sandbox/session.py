"""A persistent, sandboxed Python session for one episode (math-tir's tool calls).

The guest interpreter (`guest.py`) runs inside the same layers as a one-shot run and keeps one
namespace across calls. A call that times out, floods output, runs out of memory or kills the
interpreter ends that interpreter (the whole sandbox, threads and subprocesses included); the
next call starts a fresh one and its result says so. Creating a Session spawns nothing, so
it is cheap and safe from many threads; the sandbox starts on the first call.

Between calls nothing in the sandbox runs: once a call's reply is in, every process of the
sandbox is stopped (SIGSTOP, all threads), and the next call continues them, so a thread a
call left spinning costs no CPU while the session waits and its work is charged to the calls
it runs in. Each call carries a random token that its reply must echo; a reply line that is
not the awaited one (code that wrote to the protocol pipe) ends the interpreter with an error
instead of letting later calls receive earlier calls' output. That keeps accidents and naive
writes from shifting outputs between calls; it does not stop a call's code from taking over
the interpreter and forging later calls' results (guest.py says how, #34 item 9).
"""

from __future__ import annotations

import secrets
import struct
import threading
import time
import weakref
from types import TracebackType
from typing import Self

from agentrl.sandbox.command import Plan
from agentrl.sandbox.config import ExecResult, SandboxConfig, Status
from agentrl.sandbox.launch import StartError, classify, decode, said, start
from agentrl.sandbox.process import Child

_HEADER = struct.Struct("!Qd16s")  # Must match guest.py.
_DRAIN_S = 0.05
_NOTE = ("[agentrl.sandbox] the previous interpreter of this session ended ({why}); this call "
         "ran in a fresh one: earlier variables and imports are gone.\n")
_DESYNC = ("[agentrl.sandbox] the session's reply pipe received a line that is not this call's "
           "reply (the code wrote to the sandbox's protocol pipe); the interpreter was ended so "
           "no later call can receive another call's output, and the next call starts a fresh "
           "one.\n")


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
        timeout = self._cfg.call_timeout(code, timeout_s)
        with self._lock, self._slots:
            if self._closed:
                raise RuntimeError("Session.run after close(); open a new one with "
                                   "Sandbox.session()")
            clock = time.monotonic()
            note, restarted = "", False
            if self._holder.child is not None and self._holder.child.proc.poll() is not None:
                self._holder.close()  # Killed while paused (from outside, or the OOM killer).
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
        token = secrets.token_hex(8).encode()
        child.resume()
        child.send(_HEADER.pack(len(data), self._cfg.cpu_time_s or 0.0, token) + data)
        oom_before = child.cgroup.oom_kills() if child.cgroup is not None else 0
        event = child.pump(deadline, want_message=True)
        if event == "message":
            child.drain(_DRAIN_S)
            if not child.overflow:
                return self._finished(child, token, oom_before, clock)
            event = "overflow"
        # The interpreter is gone or must go: timeout, flood, OOM kill or a crash.
        self._end(child)
        stdout, stderr, truncated = child.take_output()
        status, rc = classify(child, event, oom_before)
        self._lost = f"status {status}" if status != "ok" else "the code exited it"
        return ExecResult(status, rc, decode(stdout), decode(said(status, stderr)),
                          time.monotonic() - clock, truncated)

    def _end(self, child: Child) -> None:
        """Kill this call's interpreter; the next call starts a fresh one."""
        self._holder.child = None
        child.close()

    def _finished(self, child: Child, token: bytes, oom_before: int,
                  clock: float) -> ExecResult:
        """A call the guest answered: its own exit-like code decides the status."""
        reply = _parse_reply(child.take_message() or b"", token)
        child.pause()
        if reply is None or child.stray_message():
            self._end(child)
            self._lost = "its protocol pipe was written to by the code"
            stdout, stderr, truncated = child.take_output()
            return ExecResult("error", None, decode(stdout), decode(stderr) + _DESYNC,
                              time.monotonic() - clock, truncated)
        rc, exc = reply
        stdout, stderr, truncated = child.take_output()
        status: Status = "ok" if rc == 0 else "error"
        oom_now = child.cgroup.oom_kills() if child.cgroup is not None else 0
        if rc != 0 and (exc == "MemoryError" or oom_now > oom_before):
            status = "oom"
        return ExecResult(status, rc, decode(stdout), decode(stderr), time.monotonic() - clock,
                          truncated)


def _parse_reply(line: bytes, token: bytes) -> tuple[int, str] | None:
    """(rc, exception name or "-") from `TOKEN RC EXC`; None unless it is this call's reply."""
    parts = line.split(b" ")
    if len(parts) != 3 or parts[0] != token:
        return None
    try:
        return int(parts[1]), parts[2].decode("ascii")
    except ValueError:
        return None
