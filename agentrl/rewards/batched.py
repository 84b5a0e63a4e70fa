"""Rewards scored a batch at a time: calls from concurrent episodes (env steps run in a thread
pool) are gathered and scored together by a service or a model."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class RewardServiceError(RuntimeError):
    """The reward service did not score a sample: the episode is discarded and counted."""


class BatchedReward:
    """`reward_fn(prompt, response, label)` whose calls from concurrent episodes (env steps run
    in a thread pool) are scored together: up to `max_batch` at a time, gathered for
    `window_s`, by `_score` (a subclass's). A failure ends the episodes of that batch as
    discarded (`RewardServiceError`: counted, not a crashed run)."""

    def __init__(self, name: str, *, max_batch: int = 64, window_s: float = 0.01,
                 wait_s: float = 600.0) -> None:
        import queue
        import threading

        self.max_batch, self.window_s, self.wait_s = max_batch, window_s, wait_s
        self.__qualname__ = name  # how errors name it
        self._queue: queue.SimpleQueue[tuple[dict[str, Any], Future[dict[str, Any]]]] = (
            queue.SimpleQueue())
        self._sender: threading.Thread | None = None
        self._lock = threading.Lock()

    def _score(self, items: list[dict[str, Any]]) -> list[dict[str, Any] | RewardServiceError]:
        """Each item's {"reward": float, **info}, or the error for it."""
        raise NotImplementedError

    def __call__(self, prompt: Any, response: str, label: Any) -> dict[str, Any]:
        import threading

        done: Future[dict[str, Any]] = Future()
        self._queue.put(({"prompt": prompt, "response": response, "label": label}, done))
        with self._lock:
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                                name="agentrl-reward-client")
                self._sender.start()
        # The sender answers every call; the bound only guards against a bug leaving one hung.
        return done.result(timeout=self.wait_s)

    def _send_loop(self) -> None:
        import queue
        import time

        while True:
            batch = [self._queue.get()]
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            try:
                results = self._score([item for item, _ in batch])
            except Exception as e:  # noqa: BLE001 - whatever it is, no episode may hang on it
                error = e if isinstance(e, RewardServiceError) else RewardServiceError(
                    f"{self.__qualname__}: {type(e).__name__}: {e}")
                for _, done in batch:
                    done.set_exception(error)
                continue
            for (_, done), result in zip(batch, results, strict=True):
                if isinstance(result, RewardServiceError):
                    done.set_exception(result)
                else:
                    done.set_result(result)
