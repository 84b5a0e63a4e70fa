"""DeepSpeed ZeRO (stages 1-3), the alternative to FSDP2.

Ranks are Ray actors as under FSDP2. The worker keeps its own loss normalisation (global token
and sequence counts) and micro-batch loop; DeepSpeed partitions optimizer state (and gradients
at stage 2, parameters at stage 3), reduces gradients, clips and steps at the accumulation
boundary. Forward passes go through the engine (`module`): at stage 3 it gathers each layer's
parameters and counts micro-steps, without which accumulated gradients overwrite each other. A
torch AdamW is passed in so nothing is JIT-compiled beyond DeepSpeed's one communication op
(cached in TORCH_EXTENSIONS_DIR after the first run: ~98 CPU-seconds of g++, about 2 min on a
busy 2-core CPU; benchmarks/results/deepspeed_compile.md).

`state_dict` holds the full (gathered) module state plus every rank's optimizer partition, so
a resume needs the same world size, as DeepSpeed's own `load_state_dict` does. A frozen model
(the reference) is not wrapped: every rank keeps a whole copy on its device. Of a LoRA model only
the adapters reach the optimizer: stages 1-2 keep the frozen base whole on every rank, stage 3
partitions it as any weight (and gathers it for `full_weights`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor, nn

from agentrl.backends.base import LossFn, OptimizerSpec, raise_if_non_finite
from agentrl.backends.device import process_group_backend
from agentrl.backends.distributed import gather_objects, world
from agentrl.backends.local import LocalBackend


class DeepSpeedBackend(LocalBackend):
    name = "deepspeed"
    fused_adam = False

    engine: Any = None
    micro: int = 0

    def setup(self, model: nn.Module, optim: OptimizerSpec | None, device: torch.device) -> None:
        super().setup(model, optim, device)
        if optim is None:
            return
        d = self.dist
        url = urlparse(d.addr)
        os.environ.update(RANK=str(d.rank), WORLD_SIZE=str(d.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=url.hostname or "127.0.0.1", MASTER_PORT=str(url.port))
        import deepspeed

        deepspeed.init_distributed(dist_backend=process_group_backend(device))
        zero: dict[str, Any] = {"stage": d.zero_stage}
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        if d.zero_stage == 3 and hidden:
            # Keep only parameters below 10 x hidden (norms, biases) whole on every rank, as the
            # transformers integration's "auto" does; DeepSpeed's fixed 1e5 would keep every
            # matrix of a small model whole, so nothing would be partitioned.
            zero["stage3_param_persistence_threshold"] = 10 * hidden
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": d.micro_batches_per_step,
            "gradient_clipping": optim.max_grad_norm,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31,
        }
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=self.optimizer, config=config
        )

    @property
    def module(self) -> nn.Module:
        return self.engine if self.engine is not None else super().module

    def forward_backward(self, micro_batch: Any, loss_fn: LossFn) -> dict[str, float]:
        loss, metrics = loss_fn(self.module, micro_batch)
        raise_if_non_finite(loss, self.zero_grad)
        engine = self.engine
        # DeepSpeed divides by its accumulation steps and averages over ranks; undo both so the
        # worker's global-count normalisation is the only one.
        engine.backward(loss * world() * engine.gradient_accumulation_steps())
        engine.step()  # steps (clip, update, zero) only at the accumulation boundary
        self.micro += 1
        return metrics

    def optimizer_step(self) -> dict[str, float]:
        assert self.scheduler is not None
        self.micro = 0
        norm = self.engine.get_global_grad_norm()
        self.scheduler.step()
        return {"grad_norm": float(norm) if norm is not None else 0.0}

    def zero_grad(self) -> None:
        """Forget a skipped step's partial gradients and realign DeepSpeed's accumulation
        counter, so the next step's boundary falls where the worker's does."""
        if self.engine is None:
            return
        self.engine.zero_grad()
        # ZeRO-3 has already reduced each micro-batch into gradient partitions: this also
        # resets its micro-step count, so the next backward overwrites them.
        self.engine.optimizer.zero_grad(set_to_none=True)
        gas = self.engine.gradient_accumulation_steps()
        if self.micro % gas:
            self.engine.micro_steps += gas - self.micro % gas
        self.micro = 0

    # ------------------------------------------------------------------ state
    @property
    def partitions_weights(self) -> bool:
        """Whether each rank holds only a slice of every parameter (ZeRO-3)."""
        return self.engine is not None and bool(self.engine.zero_optimization_partition_weights())

    def _full_module_state(self) -> dict[str, Tensor]:
        import deepspeed

        module = self.engine.module
        with deepspeed.zero.GatheredParameters(
            list(module.parameters()), enabled=self.partitions_weights
        ):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            return super().state_dict()
        assert self.scheduler is not None
        return {
            "model": self._full_module_state(),
            "optimizer": gather_objects(self.engine.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every rank loads the full module state (under ZeRO-3 rank 0's copy is re-partitioned
        over the ranks on leaving the gather), then its own optimizer partition."""
        if self.engine is None:
            super().load_state_dict(state)
            return
        import deepspeed

        module = self.engine.module
        with deepspeed.zero.GatheredParameters(
            list(module.parameters()), modifier_rank=0, enabled=self.partitions_weights
        ):
            module.load_state_dict(state["model"])
        # Stage 1-2 rebuild their fp32 master partitions from the weights just loaded; stage 3
        # restores them (and its weight partitions) from the saved partitions, the same values.
        self.engine.optimizer.load_state_dict(state["optimizer"], load_from_fp32_weights=False)
        assert self.scheduler is not None
        self.scheduler.load_state_dict(state["scheduler"])

    def full_weights(self) -> Iterator[tuple[str, Tensor]]:
        if self.engine is None:
            yield from super().full_weights()
            return
        yield from self._full_module_state().items()
