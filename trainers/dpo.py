"""`agentrl dpo`: preference optimisation with DPO, conservative DPO or IPO.

    agentrl dpo --dataset pairs.jsonl                    # rows {"prompt", "chosen", "rejected"}
    agentrl dpo --dataset pairs.jsonl --loss ipo --beta 0.5
    agentrl dpo --dataset pairs.jsonl --label_smoothing 0.1   # conservative DPO

The pairs are trainers/pairs.py's; the log-likelihood of a reply is the sum over its tokens.

The reference log-likelihoods are computed once, before the first update, with the reference
model: `--ref_model` or, by default, the initial policy itself. No second copy of the model is
kept while training. The losses are `agentrl.algorithms.preference.preference_loss`; reported
are the loss, the implicit rewards beta * (log pi - log pi_ref) of chosen and rejected replies,
their margin and the reward accuracy (the share of pairs ranked right), for the training steps
and the held-out pairs (`eval/...`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from agentrl.command_line import validation_deferred
from trainers.config import ActorConfig
from trainers.offline_data import OfflineData
from trainers.offline_run import cli_main, train_offline
from trainers.pairs import Pair, PairConfig, PairTrainer, load_pairs


@dataclass(frozen=True, kw_only=True)
class DPOConfig(PairConfig):
    """`agentrl dpo` flags."""

    loss: Literal["dpo", "ipo"] = "dpo"
    beta: float = 0.1
    """DPO's beta (the KL strength); IPO's tau."""
    label_smoothing: float = 0.0
    """Conservative DPO: the probability that a label is wrong (0: plain DPO)."""
    ref_model: str | None = None
    """The reference model (default: the initial --actor.model)."""
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(lr=1e-6))
    run_dir: str = "runs/dpo"

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        super().__post_init__()
        if self.margin_key is not None:
            raise ValueError("--margin_key is the reward model's (agentrl rm); DPO takes none")
        if self.beta <= 0:
            raise ValueError(f"--beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"--label_smoothing must be in [0, 0.5), got "
                             f"{self.label_smoothing}")
        if self.loss == "ipo" and self.label_smoothing:
            raise ValueError("--label_smoothing is conservative DPO's; --loss ipo takes none")


class DPOTrainer(PairTrainer):
    """Scores are the implicit rewards beta * (log pi - log pi_ref)."""

    kind = "dpo"
    score_name = "rewards"

    def __init__(self, cfg: DPOConfig, data: OfflineData[Pair], tokenizer: Any,
                 **dist: Any) -> None:
        super().__init__(cfg, data.train, data.eval, tokenizer, **dist)
        self.dcfg = cfg
        self._reference_logprobs(data.train + data.eval)

    def _reference_logprobs(self, pairs: list[Pair]) -> None:
        """log pi_ref of every reply, once: with the initial policy (this trainer's model
        before any update) or the --ref_model. Every rank scores every pair (in the same
        passes, as a sharded policy needs); a --ref_model is a plain copy on each rank."""
        import torch

        module, backend = self.backend.module, None
        if self.dcfg.ref_model is not None and self.dcfg.ref_model != self.cfg.actor.model:
            from agentrl.backends import DistSpec, create_backend, resolve_backend_name
            from agentrl.models import load_model

            name = "local" if self.world > 1 else self.cfg.backend
            backend = create_backend(resolve_backend_name(name, self.device), DistSpec())
            backend.setup(load_model(self.dcfg.ref_model, dtype=self.cfg.actor.dtype).eval(),
                          None, self.device)
            module = backend.module
        step = self.cfg.micro_batch_size
        with torch.no_grad():
            for i in range(0, len(pairs), step):
                chunk = pairs[i : i + step]
                values = self._sequence_logprobs(module, chunk)
                for p, (c, r) in zip(chunk, values.view(-1, 2).tolist(), strict=True):
                    p.ref_chosen, p.ref_rejected = c, r
        del backend

    def _sequence_logprobs(self, module: Any, pairs: list[Pair]) -> Any:
        """log pi(reply | prompt) of each pair's chosen and rejected reply, `[2P]` in order."""
        from agentrl.algorithms.preference import sequence_logprobs

        batch = self.replies_batch(pairs)
        [(idx, n)] = batch.micro_batches(list(range(batch.size)), batch.size)
        logp = self.logprobs(module, batch, (idx, n))
        return sequence_logprobs(logp, batch.mask[idx, : n - 1])

    def pair_loss(self, module: Any, pairs: list[Pair]) -> tuple[Any, Any, Any]:
        import torch

        from agentrl.algorithms.preference import preference_loss

        seq = self._sequence_logprobs(module, pairs)
        ref = torch.tensor([[p.ref_chosen, p.ref_rejected] for p in pairs], device=seq.device)
        out = preference_loss(seq[0::2], seq[1::2], ref[:, 0], ref[:, 1], beta=self.dcfg.beta,
                              kind=self.dcfg.loss, label_smoothing=self.dcfg.label_smoothing)
        return out.loss_B, out.chosen_reward_B, out.rejected_reward_B


def run_dpo(cfg: DPOConfig) -> dict[str, Any]:
    return train_offline(cfg, load_pairs, DPOTrainer, "pairs")


def main(argv: list[str]) -> int:
    return cli_main(DPOConfig, run_dpo, "agentrl dpo", __doc__, argv)
