"""Parent-side supervision of one sandbox process (sandbox.md layer 7).

`Child` owns the process, its pipes, its cgroup and its scratch dir. `pump` is the only loop:
non-blocking reads of stdout/stderr with a per-stream cap, the status pipe, an optional
message pipe (sessions), an optional pending write to stdin (a session's next code), and the
wall deadline; it never waits on EOF alone, so a grandchild holding a pipe open cannot turn a
finished program into a timeout. `close` always kills, verifies nothing is left, and cleans up.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from agentrl.sandbox import identity
from agentrl.sandbox.cgroup import Cgroup

logger = logging.getLogger(__name__)

PumpEvent = Literal["message", "exit", "overflow", "timeout"]
_READ_CHUNK = 1 << 16
_PROTOCOL_CAP = 1 << 16
"""Most unconsumed bytes kept from the status and message pipes: their lines are a few dozen
bytes, so more is a flood (guest code that found the pipe) and ends the run like an output
flood, instead of growing the caller's memory."""
_EXIT_GRACE_S = 0.2
_PAUSE_SWEEPS = 16
_KILL_WAIT_S = 10.0
# One long-lived spawning thread: bwrap --die-with-parent uses PR_SET_PDEATHSIG, which fires
# when the *thread* that forked it exits. A session started from a short-lived worker thread
# would otherwise be killed the moment that thread returned.
_spawner: list[ThreadPoolExecutor] = []


def _new_spawner() -> None:
    """(Re)create the spawner; after fork() the child has the executor but not its thread."""
    _spawner[:] = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-sandbox-spawn")]


_new_spawner()
os.register_at_fork(after_in_child=_new_spawner)


def spawn(argv: list[str], *, env: dict[str, str], stdin: int, pass_fds: tuple[int, ...],
          cwd: str | None) -> subprocess.Popen[bytes]:
    """Start the chain on the spawner thread, in its own process group, stdio piped."""
    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd=cwd, pass_fds=pass_fds,
                                close_fds=True, process_group=0)
    return _spawner[0].submit(start).result()


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):  # Old kernel: fall back to polling.
        return None


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:  # Gone already (or not ours: never the case for a sandbox's own pids).
        pass


def _descendants(root: int) -> set[int]:
    """Live processes below `root`, from every /proc entry's parent pid (no cgroup to ask)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


class Child:
    """A started sandbox; not thread-safe (a Session serialises its calls)."""

    def __init__(self, proc: subprocess.Popen[bytes], *, cap: int, isolated: bool,
                 status_r: int, msg_r: int | None = None, stdin_w: int | None = None,
                 cgroup: Cgroup | None = None, work_dir: str | None = None,
                 gate_w: int | None = None, uid: int | None = None) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc, self.cap, self.isolated = proc, cap, isolated
        self.cgroup, self.work_dir = cgroup, work_dir
        self.uid = uid
        """The host uid of this sandbox alone (`identity.py`), given back once it is empty."""
        self._owner = os.getpid()
        self._out_fd, self._err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        self._status_r, self._msg_r, self._stdin_w = status_r, msg_r, stdin_w
        self._gate_w = gate_w
        self.buffers: dict[int, bytearray] = {fd: bytearray() for fd in
                                              (self._out_fd, self._err_fd, status_r)}
        if msg_r is not None:
            self.buffers[msg_r] = bytearray()
        self._poll = select.poll()
        for fd in self.buffers:
            os.set_blocking(fd, False)
            self._poll.register(fd, select.POLLIN)
        self._exit_fd = _pidfd_open(proc.pid)
        if self._exit_fd is not None:
            self._poll.register(self._exit_fd, select.POLLIN)
        if stdin_w is not None:
            os.set_blocking(stdin_w, False)
        self._open = set(self.buffers)
        self._pending = memoryview(b"")
        self.overflow = False
        self.exited = False
        self._exited_at = 0.0
        self._init_pid: int | None = None
        self._init_pidfd: int | None = None
        self.closed = False
        self.leaked = False
        self.oom_kills = 0
        """OOM kills in the cgroup over its life (read at close, before it is removed)."""

    @property
    def started(self) -> bool:
        """Every layer is up and python was about to be exec'd (command.NOTICE said so)."""
        return b"started" in bytes(self.buffers[self._status_r]).splitlines()

    def send(self, data: bytes) -> None:
        """Queue bytes for the session's stdin; `pump` writes them without blocking."""
        assert self._stdin_w is not None
        self._pending = memoryview(data)
        self._poll.register(self._stdin_w, select.POLLOUT)

    def take_output(self) -> tuple[bytes, bytes, bool]:
        """stdout, stderr (each cut at the cap) and whether anything was cut; clears them."""
        out, err = self.buffers[self._out_fd], self.buffers[self._err_fd]
        truncated = self.overflow or len(out) > self.cap or len(err) > self.cap
        result = bytes(out[: self.cap]), bytes(err[: self.cap]), truncated
        out.clear()
        err.clear()
        return result

    def take_message(self) -> bytes | None:
        """One complete line from the message pipe, if any."""
        assert self._msg_r is not None
        buf = self.buffers[self._msg_r]
        line, sep, rest = bytes(buf).partition(b"\n")
        if not sep:
            return None
        buf[:] = rest
        return line

    def stray_message(self) -> bool:
        """Bytes on the message pipe beyond the replies taken so far (read without waiting)."""
        assert self._msg_r is not None
        if self._msg_r in self._open:
            self._read(self._msg_r)
        return bool(self.buffers[self._msg_r])

    def processes(self) -> set[int]:
        """Pids of the program and everything it started (the sandbox's init excluded): the
        cgroup's members where there is one, else the descendants found in /proc."""
        if self.cgroup is not None:
            pids = self.cgroup.pids()
        elif self.isolated:
            pids = set() if self._init_pid is None else _descendants(self._init_pid)
        else:
            pids = {self.proc.pid, *_descendants(self.proc.pid)}
        pids.discard(self._init_pid or -1)
        return pids

    def pause(self) -> None:
        """SIGSTOP every process of the sandbox (all threads of each), so nothing a session
        call left behind runs between calls; stopped processes cannot fork, so re-listing
        until no new pid appears catches children started during the sweep."""
        stopped: set[int] = set()
        for _ in range(_PAUSE_SWEEPS):
            fresh = self.processes() - stopped
            if not fresh:
                return
            for pid in fresh:
                _signal(pid, signal.SIGSTOP)
            stopped |= fresh
        logger.warning("sandbox pid %s kept starting processes while being paused",
                       self.proc.pid)

    def resume(self) -> None:
        """SIGCONT what `pause` stopped (and anything else of the sandbox: a no-op for it)."""
        for pid in self.processes():
            _signal(pid, signal.SIGCONT)

    def pump(self, deadline: float, *, want_message: bool = False) -> PumpEvent:
        """Move data until an event: a message line, exit, output overflow or the deadline."""
        while True:
            if want_message and self._msg_r is not None and b"\n" in self.buffers[self._msg_r]:
                return "message"
            if self.overflow:
                return "overflow"
            outputs_open = self._open & {self._out_fd, self._err_fd}
            if self.exited and not outputs_open:
                return "exit"
            now = time.monotonic()
            if now >= deadline:
                return "exit" if self.exited else "timeout"
            tick = 0.05 if self._exit_fd is None else deadline - now
            for fd, event in self._poll.poll(max(1, int(min(tick, deadline - now) * 1000))):
                self._handle(fd, event)
            if self._exit_fd is None and self.proc.poll() is not None:
                self._on_exit()
            if self.exited and outputs_open:
                # The program is gone but a descendant may hold a pipe: take what is there
                # briefly, never wait for that descendant.
                deadline = min(deadline, self._exited_at + _EXIT_GRACE_S)

    def drain(self, max_s: float) -> None:
        """Take output already in the pipes (a session call's prints land before its reply)."""
        end = time.monotonic() + max_s
        outputs = (self._out_fd, self._err_fd)
        while not self.overflow and time.monotonic() < end:
            ready = [fd for fd, _ in self._poll.poll(0) if fd in outputs]
            if not ready:
                return
            for fd in ready:
                self._read(fd)

    def _handle(self, fd: int, event: int) -> None:
        if fd == self._exit_fd:
            self._poll.unregister(fd)
            self._on_exit()
        elif fd == self._stdin_w:
            self._write_pending(event)
        else:
            self._read(fd)

    def _write_pending(self, event: int) -> None:
        assert self._stdin_w is not None
        try:
            if not event & (select.POLLERR | select.POLLHUP):
                written = os.write(self._stdin_w, self._pending[:_READ_CHUNK])
                self._pending = self._pending[written:]
                if self._pending:
                    return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # The reader is gone; the exit event will say why.
            pass
        self._pending = memoryview(b"")
        self._poll.unregister(self._stdin_w)

    def _read(self, fd: int) -> None:
        try:
            data = os.read(fd, _READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self._open.discard(fd)
            self._poll.unregister(fd)
            return
        buf = self.buffers[fd]
        buf += data
        if fd in (self._out_fd, self._err_fd):
            if len(buf) > self.cap:
                self.overflow = True
            return
        if len(buf) > _PROTOCOL_CAP:
            del buf[_PROTOCOL_CAP:]
            self.overflow = True
        if fd == self._status_r:
            self._note_init_pid()

    def _on_exit(self) -> None:
        self.exited = True
        self._exited_at = time.monotonic()
        if not self.isolated:
            # Without a PID namespace, leftovers of the program hold the pipes open; end them.
            self._kill_tree()

    def _note_init_pid(self) -> None:
        """Keep a pidfd on the sandbox's init so killing it can never hit a recycled pid."""
        if self._init_pid is not None:
            return
        for line in bytes(self.buffers[self._status_r]).splitlines():
            try:
                info = json.loads(line)
            except ValueError:
                continue
            if isinstance(info, dict) and "child-pid" in info:
                self._init_pid = int(info["child-pid"])
                self._init_pidfd = _pidfd_open(self._init_pid)
                self._admit(self._init_pid)
                return

    def _admit(self, pid: int) -> None:
        """Move the sandbox's init into the cgroup, then open bwrap's --block-fd gate so it
        starts the program (which inherits the cgroup). Done here, not by a wrapper before
        bwrap, because a cgroup migration can wait out an RCU grace period (~10 ms on this
        machine) and here that wait overlaps bwrap's own mount set-up."""
        if self._gate_w is None or self.closed:  # Closing: it must never start.
            return
        gate, self._gate_w = self._gate_w, None
        try:
            if self.cgroup is not None:
                for procs in self.cgroup.procs_files:
                    with open(procs, "w") as f:
                        f.write(str(pid))
            os.write(gate, b"x")
        except OSError:  # Never let it start outside its cgroup: it will read as sandbox_error.
            logger.exception("cannot move sandbox init %s into its cgroup", pid)
            self._kill_tree()
        finally:
            os.close(gate)

    def _kill_tree(self) -> None:
        """SIGKILL the whole sandbox: its init (the PID namespace dies with it, and bwrap then
        reaps it and exits), else the process group; then whatever the cgroup still holds."""
        if self.isolated and self._init_pidfd is not None:
            try:
                signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
            except OSError:
                pass
        else:
            self._killpg()
        if self.cgroup is not None:
            self.cgroup.kill()

    def _killpg(self) -> None:
        # Only while unreaped: afterwards the pid (= our process group id) may be reused.
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass

    def close(self) -> None:
        """Kill everything, reap, verify nothing is left, release every resource. Idempotent."""
        if self.closed or os.getpid() != self._owner:  # A fork() child must not kill ours.
            return
        self.closed = True
        self.drain_status()
        self._kill_tree()
        try:
            self.proc.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            self._killpg()
            self.proc.wait()
        self.leaked = not self._verify_empty()
        if self.leaked:  # Its uid stays taken: a new sandbox must not share it with them.
            logger.error("sandbox pid %s left processes behind after kill", self.proc.pid)
        elif self.uid is not None:
            identity.release(self.uid)
        self._reap_init()
        if self.cgroup is not None:
            self.oom_kills = self.cgroup.oom_kills()
            self.cgroup.remove()
        if self._gate_w is not None:  # Never opened: kill first, as EOF would let it run.
            os.close(self._gate_w)
            self._gate_w = None
        for fd in (self._status_r, self._msg_r, self._stdin_w, self._exit_fd, self._init_pidfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        if self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def _reap_init(self) -> None:
        """bwrap exits without reaping its init, so the kernel hands that (dead) init to our
        reaper. Normally that is the container's PID 1; when it is us (the caller runs as PID 1
        or a subreaper) nobody else will reap it, so do it here or zombies pile up."""
        p_pidfd = getattr(os, "P_PIDFD", None)
        if self._init_pidfd is None or p_pidfd is None:
            return
        try:
            os.waitid(p_pidfd, self._init_pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:  # Not ours: our reaper takes care of it.
            pass

    def drain_status(self) -> None:
        """Read whatever the status pipe holds (the init pid may not have been read yet)."""
        if self._status_r in self._open:
            self._read(self._status_r)

    def _verify_empty(self) -> bool:
        if self.cgroup is not None and not self.cgroup.kill(timeout_s=_KILL_WAIT_S):
            return False
        if self._init_pidfd is not None:
            # Readable once the init has exited (and with it the whole PID namespace).
            ready, _, _ = select.select([self._init_pidfd], [], [], _KILL_WAIT_S)
            return bool(ready)
        return True
