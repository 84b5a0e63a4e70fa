"""The training-backend protocol: what the policy worker asks of local, fsdp2 and deepspeed.

A backend owns one trained (or frozen) model on one device: where its parameters live, how a
loss turns into gradients (and how gradients are reduced over ranks), the optimizer and its
schedule, and how the full weights are read back. The worker owns the RL: it computes the
log-probs and the loss (agentrl/algorithms) and hands the loss to the backend. Adding a
backend is one new file implementing `TrainBackend`, and its name in `agentrl.backends`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

LossFn = Callable[["nn.Module", Any], tuple["Tensor", dict[str, float]]]
"""`loss_fn(module, micro_batch) -> (scalar loss, metrics)`: the backend passes the module its
forward passes must call (DeepSpeed's engine, say, rather than the bare model)."""


class NonFiniteLossError(RuntimeError):
    """The loss of an update was NaN or inf; its gradients were dropped and the step skipped."""


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """AdamW and its schedule, as the backend builds them."""

    lr: float
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    warmup_steps: int = 0
    """Linear warm-up over this many optimizer steps, then constant."""
    max_grad_norm: float = 0.0
    """Clip the global gradient norm to this (0: no clipping)."""


@dataclass(frozen=True, kw_only=True)
class DistSpec:
    """Where this process sits among the data-parallel ranks of a distributed backend."""

    rank: int = 0
    """This process's rank."""
    world_size: int = 1
    """Number of ranks."""
    addr: str = ""
    """Rendezvous address of the process group (tcp://host:port)."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage."""
    micro_batches_per_step: int = 1
    """Forward/backward passes per optimizer step on each rank (DeepSpeed's accumulation)."""


class TrainBackend(Protocol):
    """One model on one device, trained (with an OptimizerSpec) or frozen (without)."""

    device: torch.device

    def setup(self, model: nn.Module, optim: OptimizerSpec | None, device: torch.device) -> None:
        """Take `model` (unsharded, on any device): move, shard or wrap it; build the optimizer."""
        ...

    @property
    def module(self) -> nn.Module:
        """What forward passes call (the model, or a wrapper such as DeepSpeed's engine)."""
        ...

    def forward_backward(self, micro_batch: Any, loss_fn: LossFn) -> dict[str, float]:
        """Run `loss_fn` and accumulate the gradient of its loss. The loss is normalised by
        global counts: the backend undoes any averaging over ranks it does itself. A non-finite
        loss on any rank drops the step's gradients on every rank and raises
        NonFiniteLossError. Returns the loss function's metrics."""
        ...

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, clear the gradients and advance the schedule; returns `grad_norm`."""
        ...

    def token_logprobs(
        self, logits_TV: Tensor, labels_T: Tensor, temperature: float, *, entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs of `labels_T` under softmax(logits / temperature) (and the entropies),
        `[T, V], [T] -> [T], [T]`, float32; the logits are not used after this."""
        ...

    def zero_grad(self) -> None:
        """Forget accumulated gradients (a skipped step's)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Full, unsharded `model`, `optimizer` and `scheduler` state (a collective)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict` (a collective)."""
        ...

    def full_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The full weights, name by name, on every rank (for engine sync and export)."""
        ...

    def release_host_memory(self, freed_bytes: int) -> None:
        """A colocated engine just freed `freed_bytes` of its caches (a hint; may do nothing)."""
        ...


def raise_if_non_finite(loss: Tensor, drop: Callable[[], None]) -> None:
    """Raise NonFiniteLossError (after `drop()`) if the loss of any rank is NaN or inf. Decided
    together, so that no rank waits in a collective another rank skipped."""
    from agentrl.backends.distributed import all_sum

    value = float(loss.detach())
    (bad,) = all_sum([0.0 if math.isfinite(value) else 1.0])
    if bad:
        drop()
        raise NonFiniteLossError(f"non-finite loss {value}")
