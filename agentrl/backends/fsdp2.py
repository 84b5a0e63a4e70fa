"""FSDP2 data parallelism: parameters, gradients and optimizer state sharded over the ranks.

Each rank (a Ray actor) holds one shard of every decoder layer and of the rest of the model
(`torch.distributed.fsdp.fully_shard`; NCCL on GPUs, gloo on CPUs) and trains on its slice of
the rollout batch. FSDP2 averages gradients over ranks in its reduce-scatter; the worker's loss
is normalised by global counts, so the loss is scaled by the world size here and N ranks give
the update of one process (tested). A frozen model (the reference) is sharded the same way.

So is a LoRA model, whose units then hold a frozen base beside trainable adapters. FSDP2 (torch
2.13) allows that mix: every parameter stays a DTensor with its own requires_grad, a unit's
parameters are all-gathered together but only the gradients that exist are reduce-scattered
(`FSDPParamGroup.post_backward`), its one-dtype check covers only trainable parameters, and a
unit whose inputs need no gradient (the first layer above frozen embeddings) is reduced from the
root's end-of-backward callback. The optimizer gets only the adapters' shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

from torch import Tensor, nn

from agentrl.backends.distributed import init_process_group, world
from agentrl.backends.local import LocalBackend


class FSDP2Backend(LocalBackend):
    name = "fsdp2"
    fused_adam = False  # DTensor parameters take the default implementation

    def _place(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        init_process_group(self.dist.rank, self.dist.world_size, self.dist.addr, self.device)
        get_decoder = getattr(model, "get_decoder", None)
        decoder = get_decoder() if get_decoder is not None else model
        for layer in getattr(decoder, "layers", []):
            fully_shard(layer)
        fully_shard(model)
        return model

    def _backward(self, loss: Tensor) -> None:
        (loss * world()).backward()

    def _clip(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        import torch

        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        # The gradients are DTensors: their norm is known after a collective.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.module, options=opts)}
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=opts)
        assert self.scheduler is not None
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        if self.optimizer is None:
            set_model_state_dict(self.module, state["model"], options=opts)
            return
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=opts,
        )
        assert self.scheduler is not None
        self.scheduler.load_state_dict(state["scheduler"])

    def full_weights(self) -> Iterator[tuple[str, Tensor]]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # A module's full state dict: plain tensors (DTensors gathered), nothing nested.
        state = cast("dict[str, Tensor]", get_model_state_dict(self.module, options=opts))
        yield from state.items()
