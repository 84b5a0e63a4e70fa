"""Placed mode's rollout worker: a Ray actor with an engine of its own copy of the weights, which
collects a step's episodes and receives the trainer's weights in buckets (or by broadcast)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

from agentrl.types import Trajectory
from trainers.config import TrainConfig
from trainers.episodes import collect_agent_episodes, collect_for_step, evaluate_engine
from trainers.rollout_engines import EngineWorker, RemoteEngine, own_engine


def weight_buckets(
    named: dict[str, torch.Tensor], bucket_mb: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Split a state dict into buckets of about `bucket_mb` MiB (one transfer each), instead of
    one parameter at a time (slow) or everything at once (a full extra copy in flight)."""
    limit = bucket_mb * 2**20
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named.items():
        bucket[name] = t
        size += t.numel() * t.element_size()
        if size >= limit:
            yield bucket
            bucket, size = {}, 0
    if bucket:
        yield bucket


WEIGHTS_GROUP = "weights"
"""The Ray concurrency group of `RolloutWorker.update_weights` and `weight_transfer`: they run
beside a `collect` in flight (partial rollout), while collects and evals, in the default group,
still run one at a time."""


class RolloutWorker:
    """Placed mode: an engine with its own copy of the weights, updated by `update_weights` (or,
    made with `weight_transfer`, by the trainer's broadcast: `weight_transfer`). With
    `extra_engines` (EngineWorker actors) or `--rollout.num_engines` > 1 in one process, its
    episodes go through a router (agentrl/engine/router.py) over all of them."""

    def __init__(self, cfg: TrainConfig, weight_transfer: str | None = None,
                 extra_engines: list[Any] | None = None,
                 extra_options: list[dict[str, Any]] | None = None) -> None:
        """`extra_engines`: EngineWorker actors, made with `extra_options` (with which a dead
        one is restarted)."""
        from agentrl.models import load_tokenizer

        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.actor.model)
        self.model, engine = own_engine(cfg, self.tokenizer, weight_transfer)
        self._transfer = weight_transfer
        self._extra_options = list(extra_options or [{} for _ in extra_engines or ()])
        self._last_weights: list[tuple[str, torch.Tensor]] | None = None
        self._pending: dict[str, torch.Tensor] = {}  # weight-sync buckets of the next version
        # A broadcast sync: the engines in the current weight group, and engines restarted
        # since (they join at the next group, and sample once an update has reached them).
        self._group_lock = threading.Lock()
        self._group_epoch = 0
        self._fan: Any = None
        self._members: list[tuple[int, Any]] = []
        self._joining: dict[int, Any] = {}
        engines = [engine]
        if extra_engines:
            engines += [RemoteEngine(a) for a in extra_engines]
        elif cfg.rollout.num_engines > 1:  # no Ray: the engines share this process
            engines += [own_engine(cfg, self.tokenizer, weight_transfer)[1]
                        for _ in range(cfg.rollout.num_engines - 1)]
        if len(engines) > 1:
            from agentrl.engine.router import EngineRouter

            self.engine: Any = EngineRouter(
                engines, restart=self._restart_engine if extra_engines else None)
        else:
            self.engine = engine

    def _restart_engine(self, i: int) -> Any:
        """A new EngineWorker in place of engine `i` (a dead actor), with the current weights:
        this worker's model copy holds them (transformers), or the last update's (vLLM). Under a
        broadcast sync this worker never holds the weights: the new engine joins the trainer's
        next weight group and the router gets it once that update has reached it (None now)."""
        import ray

        if self._transfer is not None:
            with self._group_lock:  # the group spanning the dead engine is over
                self._group_epoch += 1
        actor = (ray.remote(EngineWorker).options(**self._extra_options[i - 1])
                 .remote(self.cfg, self._transfer))
        fresh = RemoteEngine(actor)
        if self._transfer is not None:
            with self._group_lock:
                self._joining[i] = fresh
                self._group_epoch += 1
            return None
        version = self.engine.version
        weights = (list(self.model.state_dict().items()) if self.model is not None
                   else self._last_weights)
        if weights is not None and version != fresh.version:
            fresh.update_weights(weights, version)
        return fresh

    def collect(self, seeds: list[int], step: int) -> list[Trajectory]:
        fn = collect_agent_episodes if self.cfg.agent_run else collect_for_step
        return fn(self.engine, self.cfg, self.tokenizer, seeds, step)

    def update_weights(self, bucket: dict[str, torch.Tensor], version: int, last: bool) -> int:
        """Receive one bucket of `version`; the engine loads them all at the last one, so no
        request samples from a mix of two versions' weights."""
        self._pending.update(bucket)
        if last:
            pending, self._pending = self._pending, {}
            self.engine.update_weights(pending, version)
            if self.model is None and self._extra_options:
                # vLLM keeps its weights in its processes: a restarted engine needs these.
                self._last_weights = list(pending.items())
        return version

    def weight_group(self) -> tuple[int, int]:
        """(epoch, size) of the weight group the trainer's broadcast should open: its rank 0
        and the workers of every live engine and every restarted one. The epoch changes when
        an engine is restarted; the trainer then opens a new group."""
        with self._group_lock:
            return self._group_epoch, 1 + len(self._group_engines()) * self._tp

    @property
    def _tp(self) -> int:
        return self.cfg.rollout.tensor_parallel_size

    def _group_engines(self) -> list[tuple[int, Any]]:
        """(router index, engine) of every engine a new weight group spans (caller holds
        `_group_lock`)."""
        from agentrl.engine.router import EngineRouter

        if not isinstance(self.engine, EngineRouter):
            return [(0, self.engine)]
        router = self.engine
        return sorted([(i, e) for i, e in enumerate(router.engines) if router.alive[i]]
                      + list(self._joining.items()), key=lambda ie: ie[0])

    def weight_transfer(self, step: str, *args: Any) -> None:
        """One step of a broadcast weight update that the trainer's rank 0 drives into every
        engine at once (trainers/weight_sync.py; the steps:
        agentrl.engine.weight_broadcast.RECEIVER_STEPS; `FanOut` gives each engine its ranks).
        Engines restarted since the group opened join it and go back to the router once an
        update has reached them."""
        import functools

        from agentrl.engine.weight_broadcast import FanOut, receive_step

        if step == "init_weight_transfer":
            with self._group_lock:
                self._members = self._group_engines()
            calls = [e.weight_transfer if isinstance(e, RemoteEngine)
                     else functools.partial(receive_step, e) for _, e in self._members]
            self._fan = FanOut(calls, [self._tp] * len(calls))
        if self._fan is None:
            raise RuntimeError(f"{step} before init_weight_transfer")
        self._fan(step, *args)
        if step == "finish_weight_transfer":
            with self._group_lock:
                joined = {i: e for i, e in self._members if self._joining.get(i) is e}
                for i in joined:
                    del self._joining[i]
            for i, engine in joined.items():
                self.engine.readmit(i, engine)

    def evaluate(self) -> dict[str, Any]:
        return evaluate_engine(self.engine, self.cfg, self.tokenizer)

    def version(self) -> int:
        return int(self.engine.version)

    def engine_stats(self) -> dict[str, Any]:
        """The router's counts (calls per engine), or {} with one engine."""
        stats = getattr(self.engine, "stats", None)
        return stats() if callable(stats) else {}

    def named_weights(self) -> dict[str, torch.Tensor]:
        if self.model is None:
            raise ValueError("the vllm engine keeps its weights in its own processes")
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def node(self) -> str:
        """The Ray node this worker runs on."""
        from trainers.ray_utils import current_node

        return current_node()

    def close(self) -> None:
        """Stop the engine (vLLM's engine process with it) before the actor goes away."""
        self.engine.close()
