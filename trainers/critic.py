"""The PPO critic: the policy's backbone with a scalar value head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from agentrl.models.vision import is_vision_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ValueModel(torch.nn.Module):
    """Values per target position, `[B, T] -> [B, T-1]`; the head starts at zero.

    Of a vision-language model the backbone is the whole multimodal model below the LM head
    (vision tower, projector, decoder), so the critic sees the same images and inputs as the
    policy (`trainers.logprobs.padded_inputs`).
    """

    def __init__(self, lm: PreTrainedModel) -> None:
        super().__init__()
        self.backbone: torch.nn.Module
        if is_vision_config(lm.config):
            self.backbone = lm.get_submodule("model")
        else:
            self.backbone = (
                lm.get_decoder() if hasattr(lm, "get_decoder") else lm.get_submodule("model")
            )
        self.config = lm.config  # read by DeepSpeed set-up (hidden size)
        self.head = torch.nn.Linear(lm.config.get_text_config().hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def get_decoder(self) -> torch.nn.Module:
        """The decoder, whose layers FSDP2 shards one by one (as for the policy)."""
        inner = getattr(self.backbone, "get_decoder", None)  # a text model's returns itself
        return inner() if callable(inner) else self.backbone

    def forward(self, input_ids: Tensor, attention_mask: Tensor, at: Tensor | None = None,
                **inputs: Tensor) -> Tensor:
        """`inputs`: a vision-language model's images and positions. With `at` ([B] positions),
        the value of each row's hidden state there, `[B]` (a reward model's score of a whole
        sequence: `at` its last token)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               **inputs).last_hidden_state
        if at is not None:
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            return self.head(hidden[rows, at]).squeeze(-1)
        return self.head(hidden).squeeze(-1)[:, :-1]
