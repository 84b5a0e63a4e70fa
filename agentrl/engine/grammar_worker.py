"""Trial compiles of grammars in worker processes, which can be killed.

xgrammar's compile (C++) cannot be interrupted, and its cost is not predictable from the grammar
(#34 item 4): the only way to stop one is to kill the process running it. A compiled grammar
cannot come back from another process either: serialised, one for 500 optional properties is
100 MB of JSON and takes 9 s to write. So a grammar is compiled here first, on trial, and
`agentrl.engine.grammar.GrammarMasks` compiles it for itself only once it has compiled here
within its timeout: a grammar costs its compile twice, once, and is cached after.

A worker is a child process (`python -c`, so nothing of the parent's `__main__` runs again) that
reads the tokenizer and then grammars from a pipe, and answers each with `+` or `-` and the
library's reason. It ends when its pipe ends or its parent does. Starting one takes seconds (it
imports xgrammar, and with it torch), so the workers of a tokenizer are shared by every engine
of it in the process (`trial_workers`) and kept while they work.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

START_TIMEOUT_S = 300.0
"""Longest a worker may take to start (it imports xgrammar, and with it torch: 3-10 s)."""


LIBRARY_ERRORS = (RuntimeError, ValueError, TypeError)
"""What xgrammar raises for bad input (its C++ errors arrive as RuntimeError)."""


class TrialFailed(Exception):
    """The grammar library refused the grammar (the reason is the message), or crashed on it."""


class TrialTimedOut(Exception):
    """The grammar did not compile within its timeout; its worker was killed."""


class _Worker:
    """One child process, compiling one grammar at a time."""

    def __init__(self) -> None:
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        code = f"from agentrl.engine.grammar_worker import serve; serve({down_r}, {up_w})"
        root = str(Path(__file__).resolve().parents[2])  # where `agentrl` is imported from
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code], pass_fds=(down_r, up_w),
                stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})
        finally:
            os.close(down_r)
            os.close(up_w)
        self._down: IO[bytes] = os.fdopen(down_w, "wb")
        self._up: IO[bytes] = os.fdopen(up_r, "rb")

    def start(self, tokenizer_info: str) -> None:
        """Blocking: send the tokenizer (xgrammar's JSON) and wait until the worker is ready."""
        _put(self._down, tokenizer_info.encode())
        if _get(self._up) != b"ready":
            raise RuntimeError(f"the grammar compile worker exited at start (status "
                               f"{self.process.wait()}; its error is in this process's stderr)")

    def trial(self, ebnf: str) -> None:
        """Blocking: compile `ebnf`; TrialFailed with the reason where it cannot be."""
        _put(self._down, ebnf.encode("utf-8", "surrogatepass"))
        reply = _get(self._up)
        if reply is None:  # xgrammar crashed on it (in-process, the server would have)
            raise TrialFailed(f"it crashed the grammar compiler (exit status "
                              f"{self.process.wait()})")
        if reply[:1] == b"-":
            raise TrialFailed(reply[1:].decode())

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self._down, self._up):  # a thread blocked on one returns: the child is gone
            try:
                pipe.close()
            except OSError:
                pass


@dataclass
class TrialWorkers:
    """Up to `size` workers for one tokenizer (xgrammar's `TokenizerInfo` as JSON), started
    when first needed and kept while they work; a trial that times out or whose caller is
    cancelled kills its worker."""

    tokenizer_info: str
    size: int
    running: int = 0
    """Trials being compiled now."""
    killed: int = 0
    """Trials stopped by killing their worker."""
    _idle: list[_Worker] = field(default_factory=list)
    _started: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    async def trial(self, ebnf: str, timeout_s: float) -> None:
        """Compile `ebnf` in a worker: TrialFailed, TrialTimedOut, or nothing when it
        compiled. Waits while every worker is busy."""
        worker = await self._take()
        with self._lock:
            self.running += 1
        try:
            await asyncio.wait_for(asyncio.to_thread(worker.trial, ebnf), timeout_s)
        except TrialFailed:
            if worker.process.poll() is None:
                self._give_back(worker)
            else:
                self._kill(worker, stopped=False)
            raise
        except TimeoutError:
            self._kill(worker)
            raise TrialTimedOut from None
        except BaseException:  # cancelled: nobody waits for it
            self._kill(worker)
            raise
        finally:
            with self._lock:
                self.running -= 1
        self._give_back(worker)

    async def _take(self) -> _Worker:
        while True:
            with self._lock:
                if self._idle:
                    return self._idle.pop()
                start = self._started < self.size
                self._started += start
            if start:
                break
            await asyncio.sleep(0.02)  # every worker is busy
        try:
            worker = _Worker()
        except BaseException:
            with self._lock:
                self._started -= 1
            raise
        try:
            await asyncio.wait_for(asyncio.to_thread(worker.start, self.tokenizer_info),
                                   START_TIMEOUT_S)
        except BaseException:
            self._kill(worker, stopped=False)
            raise
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def _kill(self, worker: _Worker, *, stopped: bool = True) -> None:
        worker.kill()
        with self._lock:
            self._started -= 1
            self.killed += stopped

    def stop_idle(self) -> int:
        """End the workers not compiling now (the next trial starts one again); how many."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._started -= len(idle)
        for worker in idle:
            worker.kill()
        return len(idle)



_SHARED: dict[bytes, TrialWorkers] = {}
_SHARED_LOCK = threading.Lock()


def trial_workers(tokenizer_info: str, size: int) -> TrialWorkers:
    """The workers of the tokenizer `tokenizer_info` (xgrammar's JSON) in this process, made
    with `size` the first time."""
    key = hashlib.sha256(tokenizer_info.encode()).digest()
    with _SHARED_LOCK:
        workers = _SHARED.get(key)
        if workers is None:
            workers = _SHARED[key] = TrialWorkers(tokenizer_info, size)
        return workers


def stop_idle_workers() -> int:
    """End every idle worker of this process, of every tokenizer (each holds ~270 MB, and a
    process that constrains no more output has no use for them); how many."""
    with _SHARED_LOCK:
        shared = list(_SHARED.values())
    return sum(workers.stop_idle() for workers in shared)


def _put(pipe: IO[bytes], data: bytes) -> None:
    pipe.write(len(data).to_bytes(8, "big"))
    pipe.write(data)
    pipe.flush()


def _get(pipe: IO[bytes]) -> bytes | None:
    """The next message, or None at the end of the pipe."""
    head = pipe.read(8)
    if len(head) < 8:
        return None
    size = int.from_bytes(head, "big")
    data = pipe.read(size)
    return data if len(data) == size else None


def serve(down: int, up: int) -> None:
    """A worker's loop, in the child process (`_Worker` starts it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server, which kills it
    parent = os.getppid()

    def watch_parent() -> None:  # a killed server leaves no compile running
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch_parent, daemon=True).start()
    import xgrammar as xgr

    with os.fdopen(down, "rb") as pipe_in, os.fdopen(up, "wb") as pipe_out:
        info = _get(pipe_in)
        if info is None:
            return
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info.decode()),
                                       cache_enabled=False)
        _put(pipe_out, b"ready")
        while (ebnf := _get(pipe_in)) is not None:
            try:
                compiler.compile_grammar(ebnf.decode("utf-8", "surrogatepass"))
                reply = b"+"
            except LIBRARY_ERRORS as e:
                reply = b"-" + (str(e) or type(e).__name__).encode()
            _put(pipe_out, reply)
