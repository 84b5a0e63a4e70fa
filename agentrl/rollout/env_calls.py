"""An episode's env calls, off the event loop, each with a deadline.

Env code may block (code execution, graders, a custom env waiting on something that never
comes), so the rollout loop never runs it on its event loop: each episode gets one thread,
`EnvThread`, that runs its env calls in order (an env sees one thread, as it would in a plain
loop). `EnvThread.call(name, fn, timeout=)` waits for the call at most `timeout` seconds and
raises `EnvTimeoutError` when it runs past it.

A thread cannot be killed, so "ended at the deadline" means *abandoned*:

- reclaimed at once: the episode's place among those in flight, and the wait. The rollout loop
  discards the episode with the reason and goes on; no later call reaches its env.
- not reclaimed: the thread and whatever its env holds (memory, files, sockets, processes).
  If the blocked call ever returns, the thread closes the env (`env.close()`) and exits; if it
  never does, both stay until the process exits. A call that spins in Python keeps taking its
  share of the GIL meanwhile. The threads are daemons, so a blocked one does not keep the
  process from exiting (a `ThreadPoolExecutor`'s are joined at exit, and a blocked pool worker
  would also take a slot from every later episode).

`abandoned_threads()` counts the abandoned threads still running; each abandonment logs a
warning with that count. Sandboxed code has its own deadline (`agentrl.sandbox`) and ends for
real; this one is the backstop for the env code around it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class EnvTimeoutError(TimeoutError):
    """An env call ran past its deadline; its episode was abandoned (see the module docstring)."""

    call: str = ""
    """Which call: "env_fn" (building the env), "reset", "step" or "close"."""


_Call = tuple[Callable[[], Any], "asyncio.AbstractEventLoop | None", "asyncio.Future[Any] | None"]

_abandoned: set[threading.Thread] = set()
_abandoned_lock = threading.Lock()


def abandoned_threads() -> int:
    """Env threads abandoned at a deadline (in this process) whose call has not returned yet."""
    with _abandoned_lock:
        _abandoned.difference_update([t for t in _abandoned if not t.is_alive()])
        return len(_abandoned)


class EnvThread:
    """One episode's env calls, run in order on a daemon thread of their own."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def call(self, name: str, fn: Callable[..., Any], *args: Any, timeout: float | None,
                   **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on this thread; its result, or its exception re-raised, or
        `EnvTimeoutError` (about the call `name`) once `timeout` seconds (None: no limit) pass
        without either."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._calls.put((functools.partial(fn, *args, **kwargs), loop, future))
        # asyncio.wait, not wait_for: an env's own TimeoutError must stay the env's error.
        done, _ = await asyncio.wait({future}, timeout=timeout)
        if not done:
            future.cancel()
            error = EnvTimeoutError(f"env {name} did not return within {timeout:g} s "
                                    f"(env_timeout_s); the episode was abandoned")
            error.call = name
            raise error
        return future.result()

    def stop(self) -> None:
        """Let the thread exit once its calls are done."""
        self._calls.put(None)

    def abandon(self, cleanup: Callable[[], Any] | None = None) -> int:
        """Give the thread up: it runs `cleanup` (the env's `close`) if its blocked call ever
        returns, then exits. Returns the abandoned threads still running, this one included."""
        if cleanup is not None:
            self._calls.put((cleanup, None, None))
        self._calls.put(None)
        with _abandoned_lock:
            _abandoned.add(self._thread)
        return abandoned_threads()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, loop, future = item
            try:
                result, error = fn(), None
            except BaseException as e:  # noqa: BLE001 (handed to the awaiting episode)
                result, error = None, e
            if loop is None or future is None:  # an abandoned env's cleanup: nobody waits
                if error is not None:
                    logger.warning("closing an abandoned env failed: %r", error)
                continue
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop has closed: nobody waits for this answer any more
                pass


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled at its deadline
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
