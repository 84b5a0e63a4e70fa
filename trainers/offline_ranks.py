"""`--num_workers N` for the offline trainers: N data-parallel ranks, each a Ray actor holding
one trainer (trainers/offline_trainer.py says how a rank takes its share of a batch), driven
by the run loop as one trainer."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainers.offline_config import OfflineConfig
from trainers.offline_data import OfflineData
from trainers.offline_trainer import OfflineTrainer


class RankGroup:
    """The N data-parallel ranks of `--num_workers N`, each a Ray actor holding one trainer:
    every call goes to all of them (the collectives inside need every rank) and answers with
    rank 0's result. It offers what `run_offline` uses of a trainer."""

    def __init__(self, actors: list[Any], total_steps: int, *, owns_ray: bool) -> None:
        self.actors, self.total_steps, self.step = actors, total_steps, 0
        self.owns_ray = owns_ray  # whether `start` started (or joined) Ray, for `close` to stop

    @classmethod
    def start(cls, cfg: OfflineConfig, make: Callable[..., OfflineTrainer],
              data: OfflineData[Any], tokenizer: Any) -> RankGroup:
        import ray

        from trainers.ray_utils import free_tcp_address, init_ray

        owns_ray = not ray.is_initialized()
        init_ray()
        gpus = int(ray.cluster_resources().get("GPU", 0))
        cuda = gpus > 0 and cfg.actor.device in ("auto", "cuda")
        if cuda and gpus < cfg.num_workers:
            raise ValueError(f"--num_workers {cfg.num_workers} needs a GPU each; the cluster "
                             f"has {gpus}")
        cpus = float(ray.cluster_resources().get("CPU", 1)) / cfg.num_workers
        opts = {"num_gpus": 1, "num_cpus": 1} if cuda else {
            "num_cpus": math.floor(cpus) if cpus >= 1 else cpus}
        addr = free_tcp_address()
        actors: list[Any] = [
            ray.remote(_Rank).options(**opts).remote(make, cfg, data, tokenizer, r, addr)
            for r in range(cfg.num_workers)]
        total = int(ray.get(actors[0].attr.remote("total_steps")))
        return cls(actors, total, owns_ray=owns_ray)

    def _all(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get([a.call.remote(method, *args) for a in self.actors])[0]

    def restore(self, path: Path) -> None:
        self._all("restore", path)
        import ray

        self.step = int(ray.get(self.actors[0].attr.remote("step")))

    def advance(self) -> dict[str, float]:
        metrics = self._all("advance")
        self.step += 1
        return metrics

    def evaluate(self) -> dict[str, float]:
        return self._all("evaluate")

    def save(self) -> Path:
        return self._all("save")

    def export_hf(self, path: Path) -> None:
        self._all("export_hf", path)

    def close(self) -> None:
        """End the ranks, and Ray if `start` started it (a caller's Ray stays up, its CPUs or
        GPUs free again)."""
        import ray

        from trainers.ray_utils import shutdown_ray

        for actor in self.actors:
            ray.kill(actor)
        if self.owns_ray:
            shutdown_ray()


class _Rank:
    """One rank's trainer in its Ray actor."""

    def __init__(self, make: Callable[..., OfflineTrainer], cfg: OfflineConfig,
                 data: OfflineData[Any], tokenizer: Any, rank: int, addr: str) -> None:
        self.trainer = make(cfg, data, tokenizer, rank=rank, dist_addr=addr)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.trainer, method)(*args)

    def attr(self, name: str) -> Any:
        return getattr(self.trainer, name)
