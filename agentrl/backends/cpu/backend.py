"""The cpu backend: the local backend plus the speed-ups measured on CPUs (float32).

- the fused RMSNorm / SiLU-gating kernels and the fused log-prob/entropy pass (`fused.py`),
  each used only where `calibrate.choice()` measured it faster on this CPU (or as
  `AGENTRL_CPU_KERNELS` forces);
- the tied embedding's gradient rows added in place and the clipping norm from dot products
  (`grads.py`);
- freed host memory kept in the heap between steps, and given back after a colocated engine
  freed a large KV cache (`host_memory.py`).

The model's modules are replaced at `setup`, once and in place (`fused.use_fused_kernels`,
`grads.tied_embedding_rows_in_place`), by stand-ins holding the same parameters under the same
names: the state_dict, checkpoints and the weights synced to engines are the model's own.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from agentrl.backends.base import OptimizerSpec
from agentrl.backends.cpu import calibrate, fused, grads, host_memory
from agentrl.backends.local import LocalBackend

TRIM_AFTER_KV_BYTES = 256 << 20
"""Give the heap back to the OS after the engine freed at least this much KV cache: less is
not worth the page faults of re-touching the memory the update frees and reallocates."""


class CPUBackend(LocalBackend):
    name = "cpu"

    embedding_rows_in_place: bool = False
    """Whether the trained model's tied embedding adds its gradient rows in place."""

    def setup(self, model: nn.Module, optim: OptimizerSpec | None, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(
                f"--backend cpu trains on the CPU, got --actor.device {device}; use --backend "
                "local (or auto) on a GPU"
            )
        host_memory.keep_freed_memory()  # no page faults for each step's fresh tensors
        if optim is not None:
            self.embedding_rows_in_place = grads.tied_embedding_rows_in_place(model)
        if calibrate.choice().train:
            fused.use_fused_kernels(model)
        super().setup(model, optim, device)

    def _clip(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        return grads.clip_grad_norm(params, max_norm)

    def token_logprobs(
        self, logits_TV: Tensor, labels_T: Tensor, temperature: float, *, entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        if calibrate.choice().logprobs:
            # It may write the logits' gradient over the logits: the caller holds them for
            # nothing else (see fused.logprobs_and_entropy).
            got = fused.logprobs_and_entropy(logits_TV, labels_T, temperature, into_logits=True)
            if got is not None:
                return got[0], got[1] if entropy else None
        return super().token_logprobs(logits_TV, labels_T, temperature, entropy=entropy)

    def release_host_memory(self, freed_bytes: int) -> None:
        if freed_bytes >= TRIM_AFTER_KV_BYTES:
            host_memory.trim()  # the engine thread's heap; see host_memory.py
