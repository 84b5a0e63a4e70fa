"""`agentrl rm`: a pairwise (Bradley-Terry) reward model.

    agentrl rm --dataset pairs.jsonl                         # rows {"prompt", "chosen", "rejected"}
    agentrl rm --dataset pairs.jsonl --margin_key margin     # -log sigmoid(r_w - r_l - m)
    agentrl rm --dataset pairs.jsonl --loss logexp           # OpenRLHF's log(1 + exp(r_l - r_w))

The model is the PPO critic's (`agentrl.models.value.ValueModel`: the language model's backbone and
a scalar head); a reply's reward is the head's value at its last token (the end-of-turn token).
The pairs are trainers/pairs.py's. Logged per step and for the held-out pairs (`eval/...`): the
loss, the mean reward of chosen and rejected replies and the pairwise accuracy.

The result, RUN_DIR/reward_model, is the backbone as a Hugging Face model directory plus the
head (`value_head.pt`) and a marker file; `agentrl.models.value.load_reward_model(DIR)` loads
it as a ValueModel, which is also how a PPO critic can start from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from agentrl.command_line import validation_deferred
from agentrl.models.value import REWARD_MODEL_HEAD, REWARD_MODEL_MARKER
from trainers.config import ActorConfig
from trainers.offline_data import OfflineData
from trainers.offline_run import cli_main, train_offline
from trainers.pairs import Pair, PairConfig, PairTrainer, load_pairs


@dataclass(frozen=True, kw_only=True)
class RMConfig(PairConfig):
    """`agentrl rm` flags."""

    loss: Literal["sigmoid", "logexp"] = "sigmoid"
    """-log sigmoid(r_w - r_l [- margin]), or log(1 + exp(r_l - r_w)) (no margin)."""
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(lr=1e-5))
    run_dir: str = "runs/rm"

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        super().__post_init__()
        if self.loss == "logexp" and self.margin_key is not None:
            raise ValueError("--loss logexp takes no margin; use --loss sigmoid with "
                             "--margin_key")


class RMTrainer(PairTrainer):
    """Scores are the reward model's rewards."""

    kind = "rm"
    score_name = "reward"

    def __init__(self, cfg: RMConfig, data: OfflineData[Pair], tokenizer: Any,
                 **dist: Any) -> None:
        self.rcfg = cfg
        super().__init__(cfg, data.train, data.eval, tokenizer, **dist)

    def trained_module(self, model: Any) -> Any:
        from agentrl.models.value import ValueModel

        self.value_model = ValueModel(model)
        return self.value_model

    def _scores(self, module: Any, pairs: list[Pair]) -> Any:
        """Rewards of each pair's chosen and rejected reply, `[2P]` in order."""
        from agentrl.backends.device import autocast
        from trainers.logprobs import padded_inputs

        batch = self.replies_batch(pairs)
        rows = (torch.arange(batch.size, device=batch.input_ids.device),
                int(batch.lengths.max()))
        inputs = padded_inputs(batch, rows, None)
        with autocast(self.device, self.cfg.actor.mixed_precision):
            return module(**inputs, at=batch.lengths - 1).float()

    def pair_loss(self, module: Any, pairs: list[Pair]) -> tuple[Any, Any, Any]:
        from agentrl.algorithms.preference import reward_model_loss

        scores = self._scores(module, pairs)
        margin = (torch.tensor([p.margin for p in pairs], device=scores.device)
                  if self.rcfg.margin_key is not None else None)
        chosen, rejected = scores[0::2], scores[1::2]
        loss_B = reward_model_loss(chosen, rejected, kind=self.rcfg.loss, margin_B=margin)
        return loss_B, chosen, rejected

    def export_hf(self, path: Path) -> None:
        """The language model (its backbone trained) at `path`, as the policy's export is (with
        LoRA, merged, and RUN_DIR/adapter), and the reward model beside it at
        RUN_DIR/reward_model. Rank 0 writes them."""
        from agentrl.models.lora import save_trained

        full = self.full_weights()  # the ValueModel's, gathered when sharded over ranks
        if self.rank != 0:
            return
        state = None if full is None else self._language_model_state(full)
        save_trained(self.model, self.tokenizer, path, state)
        head = (self.value_model.head.state_dict() if full is None else
                {k.removeprefix("head."): v for k, v in full.items() if k.startswith("head.")})
        save_reward_model(self.model, head, self.tokenizer, path.parent / "reward_model",
                          base=self.cfg.actor.model, state=state)

    def _language_model_state(self, full: dict[str, Any]) -> dict[str, Any]:
        """The language model's state dict (its own names, peft's with LoRA) from the gathered
        ValueModel's: the backbone is the language model's decoder; an untied LM head is not
        part of the reward model (never trained) and keeps the model's weights."""
        prefix = next(n for n, m in self.model.named_modules()
                      if m is self.value_model.backbone) + "."
        state = {prefix + k.removeprefix("backbone."): v for k, v in full.items()
                 if k.startswith("backbone.")}
        if not getattr(self.model.config, "tie_word_embeddings", False):
            state.update({k: v for k, v in self.model.state_dict().items()
                          if not k.startswith(prefix)})
        return state


def save_reward_model(lm: Any, head: dict[str, Any], tokenizer: Any, path: Path, *,
                      base: str, state: dict[str, Any] | None = None) -> None:
    """A directory `load_reward_model` reads: the language model whose backbone the reward
    model shares (a ValueModel trains it in place; with LoRA, merged), its tokenizer, the head's
    state dict and a marker. `state`: the language model's full state dict where it is sharded
    over ranks (None: `lm` holds it)."""
    from agentrl.models.lora import is_lora, save_merged

    path.mkdir(parents=True, exist_ok=True)
    if is_lora(lm):
        save_merged(lm, tokenizer, path, state)  # the backbone with its adapters merged
    else:
        lm.save_pretrained(path, state_dict=None if state is None else dict(state))
        tokenizer.save_pretrained(path)
    torch.save(head, path / REWARD_MODEL_HEAD)
    (path / REWARD_MODEL_MARKER).write_text(json.dumps(
        {"kind": "agentrl reward model", "base": base, "score": "value head at the last token"},
        indent=2))


def run_rm(cfg: RMConfig) -> dict[str, Any]:
    summary = train_offline(cfg, load_pairs, RMTrainer, "pairs")
    summary["reward_model"] = str(Path(cfg.run_dir) / "reward_model")
    return summary


def main(argv: list[str]) -> int:
    return cli_main(RMConfig, run_rm, "agentrl rm", __doc__, argv)
