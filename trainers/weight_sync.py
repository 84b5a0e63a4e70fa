"""How the trained weights reach the rollout engine after every update: a pure plan from the
config, and trainer rank 0's end of the broadcast sync.

- colocated (any device) -> `in_process`: the policy actor's own engine; the transformers engine
  samples from the trained module (a version bump), vLLM loads the weights through its own RPC
  (agentrl/engine/vllm_updates.py).
- placed, on CPUs (or the transformers engine, or no Ray) -> `rpc`: buckets of tensors through
  Ray into `RolloutWorker.update_weights`.
- placed, vLLM on GPUs under Ray -> `nccl`: trainer rank 0 broadcasts each tensor straight into
  the workers of every engine (`--rollout.num_engines`: one group spans them all), GPU to GPU,
  with vLLM's weight-transfer API (agentrl/engine/weight_broadcast.py).
- replaying recorded rollouts, placed -> `none`: no rollout worker.

Without Ray the rollout worker runs in the trainer's process, on the trainer's GPU: NCCL cannot
make a group of one GPU with itself, so that run syncs by `rpc`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

from trainers.config import TrainConfig

if TYPE_CHECKING:
    from torch import Tensor

    from agentrl.engine.weight_broadcast import WeightBroadcaster

WeightSync = Literal["none", "in_process", "rpc", "nccl"]


def weight_sync_plan(cfg: TrainConfig, gpus: int) -> WeightSync:
    """The weight sync of a run of `cfg` on a cluster (or machine) with `gpus` GPUs (see the
    module docstring). Pure: no Ray, no CUDA."""
    if cfg.rollout.mode != "placed":
        return "in_process"
    if cfg.replay is not None:
        return "none"
    device = cfg.actor.device
    cuda = device.startswith("cuda") or (device == "auto" and gpus > 0)
    if cuda and cfg.rollout.engine == "vllm" and cfg.use_ray:
        return "nccl"
    return "rpc"


def engine_weight_transfer(plan: WeightSync) -> str | None:
    """The `weight_transfer` the rollout engine is made with for `plan`."""
    return "nccl" if plan == "nccl" else None


class BroadcastSync:
    """Trainer rank 0's end of the broadcast sync with the rollout worker's engines, opened on
    the first `send` (both ends must be up: the engines join the group then). The rollout
    worker says how large the group is (`RolloutWorker.weight_group`); when that changes (an
    engine was restarted) or an earlier send failed, the next send opens a new group."""

    def __init__(self, backend: str, tied: bool) -> None:
        self.backend, self.tied = backend, tied
        self.sender: WeightBroadcaster | None = None
        self.group: tuple[int, int] | None = None

    def send(self, rollout: Any, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """`rollout`: the `RolloutWorker` (a Ray actor, or the object itself)."""
        from agentrl.engine.vllm_weights import with_tied_head
        from agentrl.engine.weight_broadcast import WeightBroadcaster

        epoch, size = _caller(rollout, "weight_group")()
        group = (int(epoch), int(size))
        if self.sender is not None and (self.sender.broken or group != self.group):
            self.close()
        if self.sender is None:
            self.sender = WeightBroadcaster(_caller(rollout, "weight_transfer"),
                                            backend=self.backend, world_size=size,
                                            address=_node_address())
            self.group = group
        self.sender.send(with_tied_head(weights, self.tied), version)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def _caller(rollout: Any, name: str) -> Callable[..., Any]:
    """`call(*args)` running the `RolloutWorker` method `name` where the worker is (in its
    weights concurrency group, beside a collect in flight)."""
    method = getattr(rollout, name)
    if hasattr(method, "remote"):  # a Ray actor handle
        import ray

        from trainers.rollout_worker import WEIGHTS_GROUP

        group = method.options(concurrency_group=WEIGHTS_GROUP)
        return lambda *args: ray.get(group.remote(*args))
    return method


def _node_address() -> str:
    """This machine's address as Ray knows it (the engine may run on another node)."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
