"""The driver's workers: the policy worker (or its data-parallel ranks) and the rollout worker,
started as Ray actors (`use_ray=False`: objects in this process) and called through one
interface, `Handle` or `PolicyRanks`. A worker that dies ends the run with a `TrainingError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrl.backends import DISTRIBUTED
from trainers.config import TrainConfig
from trainers.ray_utils import actor_options, free_tcp_address

if TYPE_CHECKING:
    from trainers.weight_sync import WeightSync


class TrainingError(RuntimeError):
    """Training cannot go on; the last checkpoint is intact and named in the message."""


class Handle:
    """Calls methods on a local object or a Ray actor with one interface."""

    def __init__(self, obj: Any, remote: bool) -> None:
        self.obj, self.remote = obj, remote

    def submit(self, method: str, *args: Any, group: str | None = None) -> Any:
        """Start `method`; on an actor, in its concurrency `group` if one is named."""
        if self.remote:
            call = getattr(self.obj, method)
            return (call.options(concurrency_group=group) if group else call).remote(*args)
        return getattr(self.obj, method)(*args)

    def result(self, future: Any) -> Any:
        if isinstance(future, Ready):
            return future.value
        if not self.remote:
            return future
        import ray

        try:
            return ray.get(future)
        except ray.exceptions.RayActorError as e:
            raise TrainingError(f"a Ray worker died: {e}") from e

    def call(self, method: str, *args: Any, group: str | None = None) -> Any:
        return self.result(self.submit(method, *args, group=group))

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """The one worker's result, as a list (as `PolicyRanks.call_all` gives every rank's)."""
        return [self.call(method, *args)]


class PolicyRanks:
    """Data-parallel policy ranks: every call goes to all of them (collectives inside need
    every rank); `call` gives rank 0's result, `call_all` every rank's. `train` gets each rank
    its slice of the batch, with the slice of the step's group ids (numbered once over the
    whole batch)."""

    remote = True

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self.obj = actors[0]

    def call(self, method: str, *args: Any) -> Any:
        return self.call_all(method, *args)[0]

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Every rank's result, in rank order."""
        import ray

        if method == "train":
            trajs, kl_coef, group_ids = args
            # Contiguous, sizes differing by at most one (after discards the batch need not
            # divide evenly); losses use global counts, so the update is the same.
            n, ranks = len(trajs), len(self.actors)
            bounds = [n * i // ranks for i in range(ranks + 1)]
            futures = [
                a.train.remote(trajs[bounds[i] : bounds[i + 1]], kl_coef,
                               group_ids[bounds[i] : bounds[i + 1]])
                for i, a in enumerate(self.actors)
            ]
        else:
            futures = [getattr(a, method).remote(*args) for a in self.actors]
        try:
            return list(ray.get(futures))
        except ray.exceptions.RayActorError as e:
            raise TrainingError(f"a Ray worker died: {e}") from e


class Ready:
    """A rollout already in hand, standing in the queue where a future would."""

    def __init__(self, value: Any) -> None:
        self.value = value


@dataclass
class Workers:
    policy: Handle | PolicyRanks
    rollout: Handle | None
    """The worker that samples: the rollout worker, or (colocated) the policy worker's own
    handle; None when replaying recorded rollouts."""
    engine_actors: list[Any] = field(default_factory=list)
    """--rollout.num_engines' extra EngineWorker actors."""


def visible_gpus(cfg: TrainConfig) -> int:
    """GPUs the run can use: in its Ray cluster (started or joined here), or in this process."""
    if cfg.use_ray:
        import ray

        from trainers.ray_utils import init_ray

        init_ray(address=cfg.ray.address)
        return int(ray.cluster_resources().get("GPU", 0))
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def start_workers(cfg: TrainConfig, weight_sync: WeightSync) -> Workers:
    """The run's workers; `weight_sync` is how weights reach a rollout worker
    (trainers/weight_sync.py)."""
    from trainers.policy import PolicyWorker
    from trainers.rollout_worker import RolloutWorker

    placed = cfg.rollout.mode == "placed"
    # The policy samples only when colocated and not replaying recorded rollouts ... and for
    # evals, which run on the rollout worker when there is one.
    engine = not placed and (cfg.replay is None or cfg.eval_problems > 0)
    if cfg.use_ray:
        workers = _start_actors(cfg, weight_sync, engine=engine,
                                rollout=placed and cfg.replay is None)
    else:
        workers = Workers(Handle(PolicyWorker(cfg, with_engine=engine), False), None)
        if placed and cfg.replay is None:
            workers.rollout = Handle(RolloutWorker(cfg), False)
    if workers.rollout is None and cfg.replay is None:
        # Colocated: the policy worker samples too (a single one: distributed backends are
        # placed, which the config checks).
        assert isinstance(workers.policy, Handle)
        workers.rollout = workers.policy
    return workers


def _start_actors(
    cfg: TrainConfig, weight_sync: WeightSync, *, engine: bool, rollout: bool
) -> Workers:
    import ray

    from trainers.policy import PolicyWorker
    from trainers.rollout_engines import EngineWorker
    from trainers.rollout_worker import WEIGHTS_GROUP, RolloutWorker
    from trainers.weight_sync import engine_weight_transfer

    policy_opts, rollout_opts = actor_options(cfg, rollout=rollout)
    policy: Handle | PolicyRanks
    if cfg.backend in DISTRIBUTED:
        addr = free_tcp_address()
        policy = PolicyRanks([
            ray.remote(PolicyWorker).options(**opts).remote(
                cfg, with_engine=False, rank=r, world_size=cfg.num_policy_workers, dist_addr=addr)
            for r, opts in enumerate(policy_opts)
        ])
    else:
        actor = ray.remote(PolicyWorker).options(**policy_opts[0]).remote(cfg, with_engine=engine)
        policy = Handle(actor, True)
    if not rollout:
        return Workers(policy, None)
    # Engines past the first live in actors of their own; the rollout worker routes between its
    # engine and theirs.
    transfer = engine_weight_transfer(weight_sync)
    extra = [ray.remote(EngineWorker).options(**opts).remote(cfg, transfer)
             for opts in rollout_opts[1:]]
    # A weight update (or broadcast step) runs in its own concurrency group, while an async
    # batch is still being collected: its requests go on with the new weights (partial rollout)
    # instead of the update waiting for the longest of them.
    # (Ray's type stubs lack `concurrency_groups`, which only `ray.remote` takes.)
    remote = ray.remote(concurrency_groups={WEIGHTS_GROUP: 1})  # type: ignore[call-overload]
    worker = remote(RolloutWorker).options(**rollout_opts[0]).remote(
        cfg, transfer, extra, rollout_opts[1:])
    return Workers(policy, Handle(worker, True), extra)


def worker_nodes(workers: Workers) -> dict[str, Any]:
    """Which Ray node each worker runs on: policy ranks in order, and the rollout worker."""
    policy = workers.policy
    ranks = [policy.call("node")] if isinstance(policy, Handle) else policy.call_all("node")
    out: dict[str, Any] = {"policy": ranks}
    if workers.rollout is not None and workers.rollout is not policy:
        out["rollout"] = workers.rollout.call("node")
    return out
