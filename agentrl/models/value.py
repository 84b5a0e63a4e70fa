"""A language model's backbone with a scalar value head: PPO's critic, and the reward models
`agentrl rm` trains (saved as a model directory, the head's `value_head.pt` and a marker file)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

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


REWARD_MODEL_MARKER = "agentrl_reward_model.json"
REWARD_MODEL_HEAD = "value_head.pt"


def check_reward_model(path: str | Path, what: str = "") -> Path:
    """`path` as a Path, or a ValueError unless it is a directory `save_reward_model` wrote
    (`what`: the flag that named it, for the message)."""
    p = Path(path)
    if not (p / REWARD_MODEL_MARKER).is_file() or not (p / REWARD_MODEL_HEAD).is_file():
        name = f"{what} {p}" if what else repr(str(p))
        raise ValueError(f"{name}: not a reward model saved by `agentrl rm` (expected "
                         f"{REWARD_MODEL_MARKER} and {REWARD_MODEL_HEAD}; it is "
                         f"RUN_DIR/reward_model)")
    return p


def load_reward_model(path: str | Path) -> Any:
    """The reward model saved by `agentrl rm`, as a ValueModel (in eval mode)."""
    from agentrl.models import load_model

    p = check_reward_model(path)
    model = ValueModel(load_model(str(p)))
    model.head.load_state_dict(torch.load(p / REWARD_MODEL_HEAD, weights_only=True))
    return model.eval()
