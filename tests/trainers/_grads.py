"""The gradient an update applies, caught before its optimizer step (tests that compare updates
compare gradients: the loss can agree while the gradients differ, and the other way round)."""

from __future__ import annotations

from typing import Any

import torch


def catch_gradient(worker: Any, into: dict[str, torch.Tensor], key: str) -> None:
    """From now on, each optimizer step of `worker` first stores its flattened gradient (every
    parameter that has one) in `into[key]`."""
    step = worker.policy.optimizer.step

    def stepping(*args: Any, **kwargs: Any) -> Any:
        into[key] = torch.cat([p.grad.flatten() for p in worker.model.parameters()
                               if p.grad is not None])
        return step(*args, **kwargs)

    worker.policy.optimizer.step = stepping
