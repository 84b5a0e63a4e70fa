"""The PPO critic: the policy's backbone with a scalar value head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ValueModel(torch.nn.Module):
    """Values per target position, `[B, T] -> [B, T-1]`; the head starts at zero."""

    def __init__(self, lm: PreTrainedModel) -> None:
        super().__init__()
        self.backbone: torch.nn.Module = (
            lm.get_decoder() if hasattr(lm, "get_decoder") else lm.get_submodule("model")
        )
        self.config = lm.config  # read by DeepSpeed set-up (hidden size)
        self.head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def get_decoder(self) -> torch.nn.Module:
        """The decoder, whose layers FSDP2 shards one by one (as for the policy)."""
        return self.backbone

    def forward(self, input_ids: Tensor, lengths: Tensor) -> Tensor:
        n = input_ids.shape[1]
        attn = (torch.arange(n, device=input_ids.device)[None, :] < lengths[:, None]).long()
        hidden = self.backbone(input_ids=input_ids, attention_mask=attn).last_hidden_state
        return self.head(hidden).squeeze(-1)[:, :-1]
