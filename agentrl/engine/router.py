"""Many engines as one: `EngineRouter` takes the engine protocol's calls and spreads them.

A call goes to the engine with the least outstanding work (prompt tokens plus the tokens it may
still sample, summed over the engine's calls in flight), except that every call of one
conversation (`agentrl.engine.affinity`: an episode's group in rollouts, a session in the proxy)
goes to the engine that served its first call, whose prefix cache holds the conversation so
far. Ties go to the engine that was given the fewest calls, so idle engines fill evenly.

Weight updates go to every engine with the same version: `update_weights` hands each engine the
same tensors (a bucket at a time when the caller sends buckets) and the router's `version` is
the oldest engine's. Engines are anything with the engine protocol's async `generate` (and
`generate_stream` for streaming): local engines, or handles of engines in other processes.

An engine whose process dies (its calls raise `EngineGone`) costs only its calls in flight: each
is sent again to a live engine (a conversation moves with it), the dead engine gets no more
calls, and with a `restart` function the router replaces it in a background thread (the new
engine must already hold the current weights) and counts the restart.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from agentrl.completion import Completion, CompletionDelta, SamplingParams
from agentrl.engine.affinity import affinity_key
from agentrl.engine.base import GenerationError

logger = logging.getLogger(__name__)


class EngineGone(GenerationError):
    """The engine's process is gone; its calls can be sent to another engine."""


@dataclasses.dataclass(frozen=True)
class EnginePlace:
    """Where one engine of a server runs: its device, and for a vLLM engine on GPUs the
    CUDA_VISIBLE_DEVICES its processes start with (its own GPUs; None: inherit this process's)."""

    device: str
    cuda_visible_devices: str | None = None


def engine_devices(num_engines: int, device: str, *, gpus: int, engine: str = "transformers",
                   tensor_parallel_size: int = 1, visible: Sequence[str] | None = None
                   ) -> list[EnginePlace]:
    """Where each of `num_engines` engines runs, given `gpus` visible GPUs: on GPUs each engine
    gets its own (`tensor_parallel_size` each), refused with the arithmetic when there are too
    few; on the CPU they share the cores. `device`: auto, cpu, cuda or cuda:N. A transformers
    engine goes to its GPU by device; vLLM engines, which place their own workers on the GPUs
    they see, each start with the next `tensor_parallel_size` of `visible` (this process's
    CUDA_VISIBLE_DEVICES entries; default 0..gpus-1) as theirs."""
    if num_engines < 1:
        raise ValueError(f"--num_engines must be >= 1, got {num_engines}")
    on_gpu = device.startswith("cuda") or (device == "auto" and gpus > 0)
    if not on_gpu:
        return [EnginePlace("cpu")] * num_engines
    if num_engines == 1:
        return [EnginePlace(device if device != "auto" else "cuda")]
    if device.startswith("cuda:"):
        raise ValueError(f"--num_engines {num_engines} puts each engine on its own GPU; --device "
                         f"{device} names one. Pass --device cuda (or auto)")
    need = num_engines * tensor_parallel_size
    if need > gpus:
        raise ValueError(f"--num_engines {num_engines} x --tensor_parallel_size "
                         f"{tensor_parallel_size} = {need} GPUs, but {gpus} are visible; use at "
                         f"most {max(gpus // tensor_parallel_size, 1)} engines")
    if engine == "transformers":
        return [EnginePlace(f"cuda:{i}") for i in range(num_engines)]
    ids = list(visible) if visible is not None else [str(i) for i in range(gpus)]
    tp = tensor_parallel_size
    return [EnginePlace("cuda", ",".join(ids[k * tp:(k + 1) * tp])) for k in range(num_engines)]


class EngineRouter:
    def __init__(self, engines: Sequence[Any], *, max_conversations: int = 1 << 16,
                 restart: Callable[[int], Any] | None = None) -> None:
        """`restart(i)`: a new engine to replace engine `i`, which died (called in a thread);
        or None when the new engine cannot hold the current weights yet (a broadcast sync
        brings them): its owner hands it over with `readmit` once they have reached it."""
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.engines = list(engines)
        self.alive = [True] * len(self.engines)
        self.restart = restart
        self.restarts = 0
        self._update_lock = threading.Lock()  # a restart and a weight update, one at a time
        self.retried = 0
        """Calls sent again because their engine died."""
        self.outstanding = [0] * len(self.engines)
        """Tokens of work in flight per engine (prompt + the most it may sample)."""
        self.routed = [0] * len(self.engines)
        """Calls given to each engine so far."""
        self.max_conversations = max_conversations
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()

    # ---------------------------------------------------------------- routing
    def pick(self, cost: int, key: str | None = None) -> int:
        """The engine for a call of `cost` tokens in conversation `key` (None: any)."""
        if key is not None:
            i = self._sticky.get(key)
            if i is not None and self.alive[i]:
                self._sticky.move_to_end(key)
                return i
        live = [j for j, ok in enumerate(self.alive) if ok]
        if not live:
            raise GenerationError("every engine is gone (their processes died); see the log for "
                                  "why, and restart the run")
        i = min(live, key=lambda j: (self.outstanding[j], self.routed[j], j))
        if key is not None:
            self._sticky[key] = i
            if len(self._sticky) > self.max_conversations:
                self._sticky.popitem(last=False)
        return i

    @staticmethod
    def cost(prompt_ids: Sequence[int], params: SamplingParams) -> int:
        return len(prompt_ids) + params.max_tokens * params.n

    # ---------------------------------------------------------------- the engine protocol
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       images: Sequence[Any] | None = None) -> list[Completion]:
        cost = self.cost(prompt_ids, params)
        key = affinity_key.get()
        while True:
            i = self.pick(cost, key)
            if key is not None:  # a conversation whose engine died moves with its retry
                self._sticky[key] = i
            engine = self.engines[i]
            self.outstanding[i] += cost
            self.routed[i] += 1
            try:
                return list(await engine.generate(prompt_ids, params, images))
            except EngineGone as e:
                self._lost(i, engine, e)
                self.retried += 1
            finally:
                self.outstanding[i] -= cost

    def _lost(self, i: int, engine: Any, error: BaseException) -> None:
        """Engine `i` died: no more calls to it; replace it if the router can."""
        if self.engines[i] is not engine or not self.alive[i]:
            return  # already known (another call saw it first) or already replaced
        self.alive[i] = False
        logger.warning("engine %d is gone (%s); its calls go to the others%s", i, error,
                       ", and it is restarted" if self.restart else "")
        if self.restart is None:
            return
        restart = self.restart

        def replace() -> None:
            # Under the update lock: `restart` loads the current weights into the new engine,
            # and no update can slip in between.
            with self._update_lock:
                try:
                    fresh = restart(i)
                except Exception:  # a failed restart leaves the others working
                    logger.exception("restarting engine %d failed; the run goes on without it",
                                     i)
                    return
                if fresh is not None:
                    self._admit(i, fresh)

        threading.Thread(target=replace, name=f"agentrl-restart-engine-{i}", daemon=True).start()

    def readmit(self, i: int, engine: Any) -> None:
        """Engine `i`'s replacement, which `restart` could not hand over at once, now holds
        the current weights: calls go to it again."""
        with self._update_lock:
            self._admit(i, engine)

    def _admit(self, i: int, engine: Any) -> None:
        self.engines[i] = engine
        self.outstanding[i] = 0
        self.alive[i] = True
        self.restarts += 1

    async def generate_stream(self, prompt_ids: Sequence[int], params: SamplingParams,
                              images: Sequence[Any] | None = None,
                              ) -> AsyncIterator[CompletionDelta]:
        cost = self.cost(prompt_ids, params)
        i = self.pick(cost, affinity_key.get())
        engine = self.engines[i]
        self.outstanding[i] += cost
        self.routed[i] += 1
        try:
            if hasattr(engine, "generate_stream"):
                async for delta in engine.generate_stream(prompt_ids, params, images):
                    yield delta
                return
            # An engine that does not stream: each choice whole, as one delta.
            for k, c in enumerate(await engine.generate(prompt_ids, params, images)):
                yield c.delta(k)
        finally:
            self.outstanding[i] -= cost

    async def score(self, token_ids: Sequence[int], images: Sequence[Any] | None = None, *,
                    start: int = 1) -> list[float]:
        """`Engine.score` on the least busy engine (a conversation's own, for its prefix)."""
        cost = len(token_ids)
        while True:
            i = self.pick(cost, affinity_key.get())
            engine = self.engines[i]
            self.outstanding[i] += cost
            self.routed[i] += 1
            try:
                return list(await engine.score(token_ids, images, start=start))
            except EngineGone as e:
                self._lost(i, engine, e)
                self.retried += 1
            finally:
                self.outstanding[i] -= cost

    @property
    def version(self) -> int:
        live = [e for e, ok in zip(self.engines, self.alive, strict=True) if ok] or self.engines
        return min(int(e.version) for e in live)

    @property
    def max_context(self) -> int:
        return min(int(e.max_context) for e in self.engines)

    def update_weights(self, named_tensors: Any, version: int) -> None:
        """The same tensors, as `version`, into every engine (an iterator is read once). Engines
        in other processes that can start an update without waiting (`start_update`) load at
        the same time, while this process's own engines load theirs."""
        items = (list(named_tensors.items()) if hasattr(named_tensors, "items")
                 else list(named_tensors))
        with self._update_lock:
            started = []
            for i, engine in enumerate(self.engines):
                if self.alive[i] and hasattr(engine, "start_update"):
                    started.append((i, engine, engine.start_update(items, version)))
            for i, engine in enumerate(self.engines):
                if not self.alive[i] or hasattr(engine, "start_update"):
                    continue
                try:
                    engine.update_weights(items, version)
                except EngineGone as e:
                    self._lost(i, engine, e)
            for i, engine, pending in started:
                try:
                    engine.finish_update(pending, version)
                except EngineGone as e:
                    self._lost(i, engine, e)

    def abort(self, request_id: str) -> bool:
        """Abort `request_id` on whichever engine has it (every engine is asked)."""
        found = False
        for e in self.engines:
            found = bool(getattr(e, "abort", lambda _: False)(request_id)) or found
        return found

    def sleep(self) -> None:
        for e in self.engines:
            e.sleep()

    def wake(self) -> None:
        for e in self.engines:
            e.wake()

    def close(self) -> None:
        for e in self.engines:
            e.close()

    def stats(self) -> dict[str, Any]:
        return {"engines": len(self.engines), "routed": list(self.routed),
                "outstanding": list(self.outstanding), "conversations": len(self._sticky),
                "alive": list(self.alive), "restarts": self.restarts, "retried": self.retried}
