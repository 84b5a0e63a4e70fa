"""The transformers engine's scheduler: requests waiting for a batch slot, every live request
by id, and which waiting requests the next step admits (continuous batching).

Callers submit and abort from their own threads; the engine's worker thread waits here for
work and takes admissions. One condition variable guards it all.

An idle engine waits a few milliseconds after a request arrives for others to join it, so that
requests submitted together (a rollout's episodes, resetting their envs in threads, arrive over
~10 ms) are prefilled in one pass rather than one pass for the first and another for the rest.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from agentrl.engine.base import GenerationError
from agentrl.engine.requests import Request, Sample

logger = logging.getLogger(__name__)


class Scheduler:
    """Waiting and live requests of one engine (see module docstring).

    Args:
        max_batch_size: most samples decoded together; more wait for a free slot.
        admission_window: seconds an idle engine waits for further requests after one arrives
            (until none arrived for this long, at most 5 times this in all); 0 admits at once.
    """

    def __init__(self, max_batch_size: int, admission_window: float) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.admission_window = admission_window
        self.cv = threading.Condition()
        self.pending: collections.deque[Request] = collections.deque()
        self.by_id: dict[str, Request] = {}
        self.closed = self.sleeping = False

    def submit(self, req: Request) -> None:
        """Queue a request for admission (ValueError if its id is already live)."""
        with self.cv:
            if req.id in self.by_id:
                raise ValueError(f"request id {req.id!r} is already running")
            self.by_id[req.id] = req
            self.pending.append(req)
            self.cv.notify_all()

    def abort(self, request_id: str) -> bool:
        """Mark a live request aborted; the worker ends its samples at its next step."""
        with self.cv:
            req = self.by_id.get(request_id)
            if req is None:
                return False
            req.aborted = True
            self.cv.notify_all()
        return True

    def forget(self, req: Request) -> None:
        """`req` is over (finished, aborted or failed): its id may be used again."""
        with self.cv:
            self.by_id.pop(req.id, None)

    def next_admission(self, running: Callable[[], list[Sample]],
                       abort_pending: Callable[[Request], None]) -> list[Request] | None:
        """Wait until there is work (waiting requests, or `running()` samples to decode) and
        the engine is awake; then the waiting requests to admit now (perhaps none). None once
        the engine is closed. Aborted waiting requests go to `abort_pending`."""
        with self.cv:
            while not self.closed and (self.sleeping or (not self.pending and not running())):
                self.cv.wait()
            if self.closed:
                return None
            if not running() and self.admission_window > 0:
                self._await_companions()
            return self._admit(running(), abort_pending)

    def _await_companions(self) -> None:
        """Idle, with a request waiting: give requests submitted along with it a chance to
        arrive (caller holds `cv`; submissions notify it)."""
        deadline = time.monotonic() + 5 * self.admission_window
        while not self.closed and not self.sleeping:
            waiting = len(self.pending)
            self.cv.wait(timeout=self.admission_window)
            if len(self.pending) == waiting or time.monotonic() >= deadline:
                return

    def _admit(self, rows: list[Sample], abort_pending: Callable[[Request], None]
               ) -> list[Request]:
        """Pop waiting requests that fit (caller holds `cv`)."""
        for req in [r for r in self.pending if r.aborted]:
            self.pending.remove(req)
            abort_pending(req)
        live = sum(not s.done for s in rows)
        free = self.max_batch_size - live
        waiting = sum(r.params.n for r in self.pending)
        # Admit in chunks: each admission is a prefill pass plus a copy of the batch cache.
        if live and free < min(waiting, max(1, self.max_batch_size // 8)):
            return []
        admitted: list[Request] = []
        while self.pending:
            n = self.pending[0].params.n
            if n > free and (live or admitted):
                break
            admitted.append(self.pending.popleft())
            free -= n
        return admitted

    def set_sleeping(self, sleeping: bool) -> None:
        """Hold admissions (and decode steps) until woken; waking lets the worker go on."""
        with self.cv:
            self.sleeping = sleeping
            if not sleeping:
                self.cv.notify_all()

    def close(self) -> bool:
        """Stop admitting for good; False if it already was closed."""
        with self.cv:
            if self.closed:
                return False
            self.closed = True
            self.cv.notify_all()
        return True

    def drain(self) -> list[Request]:
        """Take every waiting request out of the queue."""
        with self.cv:
            pending = list(self.pending)
            self.pending.clear()
        return pending

    def fail(self, req: Request, error: Exception) -> None:
        """End one request with a GenerationError, and only it: its samples finish (their rows
        leave the batch at the next compaction) and its caller gets the error."""
        logger.error("request %s failed; the requests batched with it go on", req.id,
                     exc_info=error)
        for s in req.samples:
            if not s.done:
                s.finish = "abort"
        self.forget(req)
        req.failed = True
        req.resolve(GenerationError(f"generation failed for this request: {error!r}"))

    def fail_all(self, error: Exception, requests: list[Request]) -> None:
        """End every one of `requests` with the step's GenerationError."""
        for req in requests:
            self.forget(req)
            req.resolve(GenerationError(f"generation failed: {error!r}"))
