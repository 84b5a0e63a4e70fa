"""The browsers of this process, as a pool: an env takes one at its first `reset` and gives it
back at `close()`, so the next episode's env starts on a running browser instead of a new one.

A rollout builds one env per episode and runs at most its concurrency of them at once
(`agentrl.rollout.collect`'s `max_concurrency`), so the pool grows to exactly that many
browsers: a browser is started only when every one is in use, and each episode holds its own
(one headless Chromium, with its private profile: nothing is shared between episodes). A run
that raises its concurrency gets more, started in parallel by the episodes' own threads; a run
can start them ahead of time with `warm(n)`.

Replaced, never repaired: a browser found dead or unanswering when taken (`acquire` checks it
with one cheap command) is closed and another started; a browser that fails during an episode
is closed by its env (the episode ends discarded with the reason, see `MiniWoBEnv`) and never
comes back. No browser outlives the process: idle ones are closed at exit, and every one is
registered with the process reaper, which ends them even after SIGKILL (`browser.py`).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from environments.miniwob.browser import Browser


@dataclass
class PoolStats:
    """What the pool has done since it was made."""

    started: int = 0
    """Browsers started."""
    reused: int = 0
    """Episodes that got a running browser."""
    replaced: int = 0
    """Idle browsers found dead or hung when taken, closed and replaced."""
    start_s: float = 0.0
    """Seconds spent starting browsers, summed over starts (parallel starts overlap)."""


class BrowserPool:
    """Idle browsers, ready for the next env (module docstring). Thread-safe."""

    def __init__(self, *, max_idle: int = 64) -> None:
        if max_idle < 0:
            raise ValueError(f"max_idle={max_idle}: expected >= 0")
        self.max_idle = max_idle
        self.stats = PoolStats()
        self._idle: list[Browser] = []
        self._lock = threading.Lock()

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def acquire(self, *, timeout_s: float) -> Browser:
        """A running browser of this episode's own: an idle one that answers, or a new one.
        Raises `BrowserError` if a new one will not start."""
        while True:
            with self._lock:
                browser = self._idle.pop() if self._idle else None
            if browser is None:
                return self._start(timeout_s)
            browser.set_timeout(timeout_s)
            if browser.responds():
                with self._lock:
                    self.stats.reused += 1
                return browser
            with self._lock:  # it closed itself (browser.run): take the next, or start one
                self.stats.replaced += 1

    def release(self, browser: Browser) -> None:
        """Take back a browser whose episode is over; a failed one is already closed and
        stays so, and one past `max_idle` is closed."""
        if browser.closed:
            return
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(browser)
                return
        browser.close()

    def warm(self, n: int, *, timeout_s: float = 20.0) -> list[float]:
        """Start browsers in parallel until `n` are idle; the seconds each start took."""
        with self._lock:
            missing = max(0, min(n, self.max_idle) - len(self._idle))
        if missing == 0:
            return []
        with ThreadPoolExecutor(max_workers=missing) as ex:
            started = list(ex.map(lambda _: self._timed_start(timeout_s), range(missing)))
        for browser, _ in started:
            self.release(browser)
        return [s for _, s in started]

    def close(self) -> None:
        """Close the idle browsers (those in use are their envs' to give back or close)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for browser in idle:
            browser.close()

    def _start(self, timeout_s: float) -> Browser:
        return self._timed_start(timeout_s)[0]

    def _timed_start(self, timeout_s: float) -> tuple[Browser, float]:
        t0 = time.perf_counter()
        browser = Browser(timeout_s=timeout_s)
        took = time.perf_counter() - t0
        with self._lock:
            self.stats.started += 1
            self.stats.start_s += took
        return browser, took


_pool: BrowserPool | None = None
_pool_owner = -1
_pool_lock = threading.Lock()


def browser_pool() -> BrowserPool:
    """This process's pool (a forked child makes its own: its parent's browsers are not its)."""
    global _pool, _pool_owner
    with _pool_lock:
        if _pool is None or _pool_owner != os.getpid():
            _pool, _pool_owner = BrowserPool(), os.getpid()
        return _pool


def close_pool() -> None:
    """Close this process's idle browsers (at exit, and for tests that leave no process)."""
    with _pool_lock:
        pool = _pool if _pool_owner == os.getpid() else None
    if pool is not None:
        pool.close()


atexit.register(close_pool)
