"""Preference pairs for `agentrl dpo` and `agentrl rm`: a prompt and a chosen and a rejected
reply, read from --dataset rows and tokenized as a rollout's replies.

A row's prompt is text (a user message) or a list of chat messages; `chosen` and `rejected` are
the two replies, as text or as an assistant message (or a one-message list, as conversational
preference datasets store them). Each reply is tokenized as `agentrl sft` tokenizes an
assistant turn (the chat-template bridge: what a policy writing it samples), after the prompt
rendered as an environment renders it. A pair whose replies are the same is a bad row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from agentrl.command_line import validation_deferred
from trainers.offline_config import OfflineConfig
from trainers.offline_data import OfflineData, read_examples, truncate
from trainers.offline_trainer import OfflineTrainer
from trainers.sft import assistant_text


@dataclass(frozen=True, kw_only=True)
class PairConfig(OfflineConfig):
    """Flags of the trainers on preference pairs (`agentrl dpo`, `agentrl rm`)."""

    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    margin_key: str | None = None
    """A column holding each pair's margin (`agentrl rm`'s sigmoid loss; default: none)."""
    batch_size: int = 8
    """Pairs per optimizer step."""
    micro_batch_size: int = 4
    """Pairs per forward/backward pass."""

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        super().__post_init__()
        if self.dataset is None:
            raise ValueError("give --dataset: preference pairs (rows with prompt, chosen and "
                             "rejected)")


@dataclass
class Pair:
    chosen: Any
    """The prompt and the chosen reply, as a trajectory (the reply is its one turn)."""
    rejected: Any
    ref_chosen: float = 0.0
    """log pi_ref(chosen | prompt)."""
    ref_rejected: float = 0.0
    margin: float = 0.0
    """How much better the chosen reply is (--margin_key), for a reward model's loss."""


def _prompt_messages(prompt: Any, where: str) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        if prompt[-1].get("role") == "assistant":
            raise ValueError(f"{where}: the prompt ends with an assistant message; the replies "
                             f"belong in chosen and rejected")
        return prompt
    raise ValueError(f"{where}: the prompt must be text or a list of chat messages")


def _reply(value: Any, where: str) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return assistant_text(value, where)


def pair_of(bridge: Any, row: dict, cfg: PairConfig, where: str) -> Pair:
    from agentrl.types import TrajectoryBuilder

    messages = _prompt_messages(row[cfg.prompt_key], where)
    chosen = _reply(row[cfg.chosen_key], f"{where} ({cfg.chosen_key})")
    rejected = _reply(row[cfg.rejected_key], f"{where} ({cfg.rejected_key})")
    if chosen == rejected:
        raise ValueError(f"{where}: chosen and rejected are the same reply; a pair needs two "
                         f"different ones")
    prompt_ids = bridge.prompt_ids(messages)

    def trajectory(text: str) -> Any:
        b = TrajectoryBuilder()
        b.add_observation(prompt_ids)
        b.add_action(bridge.action_ids(text), None)
        return b.build(terminated=True, truncated=False)

    margin = 0.0
    if cfg.margin_key is not None:
        margin = row[cfg.margin_key]
        if not isinstance(margin, int | float) or isinstance(margin, bool):
            raise ValueError(f"{where}: the margin {cfg.margin_key!r} must be a number")
    return Pair(trajectory(chosen), trajectory(rejected), margin=float(margin))


def load_pairs(cfg: PairConfig, tokenizer: Any) -> OfflineData[Pair]:
    """Every pair, tokenized and checked, before any model loads."""
    from agentrl.envs.template import ChatTemplateBridge

    bridge = ChatTemplateBridge(tokenizer)
    keys = {cfg.prompt_key: "--prompt_key", cfg.chosen_key: "--chosen_key",
            cfg.rejected_key: "--rejected_key"}
    if cfg.margin_key is not None:
        keys[cfg.margin_key] = "--margin_key"
    train, held, skipped = read_examples(
        cfg, lambda row, where: pair_of(bridge, row, cfg, where), keys=keys)
    out = OfflineData(train, held, skipped=skipped)
    out.truncated = truncate([t for p in out.train + out.eval for t in (p.chosen, p.rejected)],
                             cfg.max_len)
    return out


class PairTrainer(OfflineTrainer):
    """An offline trainer on pairs: `pair_loss` gives each pair's loss and the scores of its
    chosen and rejected replies; steps and evaluation report the loss, the mean scores, their
    margin and the share of pairs ranked right (ties count half), under `score_name`."""

    score_name = "score"

    def pair_loss(self, module: Any, pairs: list[Pair]) -> tuple[Tensor, Tensor, Tensor]:
        """(loss_B, chosen score_B, rejected score_B) of `pairs` under `module`."""
        raise NotImplementedError

    def replies_batch(self, pairs: list[Pair]) -> Any:
        """Each pair's chosen and rejected reply as one batch of 2P rows, in that order (a
        pair's chosen at row 2i, its rejected at 2i + 1)."""
        return self.batch([t for p in pairs for t in (p.chosen, p.rejected)])

    def _sums(self, module: Any, pairs: list[Pair], weights: list[float],
              divisor: float) -> tuple[Tensor, dict[str, float]]:
        loss_B, c, r = self.pair_loss(module, pairs)
        w = torch.tensor(weights, device=loss_B.device, dtype=loss_B.dtype)
        c, r = c.detach(), r.detach()
        right = (c > r).float() + 0.5 * (c == r).float()
        return (loss_B * w).sum() / divisor, {
            "loss": float((loss_B.detach() * w).sum()), "chosen": float((c * w).sum()),
            "rejected": float((r * w).sum()), "right": float((right * w).sum())}

    def _over_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        from agentrl.backends.distributed import all_sum

        return dict(zip(sums, all_sum(list(sums.values())), strict=True))

    def _metrics(self, sums: dict[str, float], n: float) -> dict[str, float]:
        n, name = max(n, 1.0), self.score_name
        return {"loss": sums["loss"] / n, f"{name}/chosen": sums["chosen"] / n,
                f"{name}/rejected": sums["rejected"] / n,
                f"{name}/margin": (sums["chosen"] - sums["rejected"]) / n,
                f"{name}/accuracy": sums["right"] / n}

    def train_step(self, items: list[Pair]) -> dict[str, float]:
        t0 = time.perf_counter()
        num_pairs = float(len(items))  # losses are summed over pairs, / the step's pairs
        mine, weights = self.shard(items, self.per_rank)
        sums = dict.fromkeys(("loss", "chosen", "rejected", "right"), 0.0)
        step = self.cfg.micro_batch_size
        for i in range(0, len(mine), step):
            w = weights[i : i + step]

            def loss_fn(module: Any, pairs: list[Pair], w: list[float] = w
                        ) -> tuple[Tensor, dict[str, float]]:
                return self._sums(module, pairs, w, num_pairs)

            m = self.backend.forward_backward(mine[i : i + step], loss_fn)
            for k in sums:
                sums[k] += m[k]
        stats = self.backend.optimizer_step()
        return {**self._metrics(self._over_ranks(sums), num_pairs), "pairs": num_pairs,
                "epoch": float(self.epoch), "time_step": time.perf_counter() - t0, **stats}

    def evaluate(self) -> dict[str, float]:
        if not self.held:
            return {}
        sums = dict.fromkeys(("loss", "chosen", "rejected", "right"), 0.0)
        step = self.cfg.micro_batch_size
        mine, weights = self.shard(self.held)
        with torch.no_grad():
            for i in range(0, len(mine), step):
                _, m = self._sums(self.backend.module, mine[i : i + step],
                                  weights[i : i + step], 1.0)
                for k in sums:
                    sums[k] += m[k]
        return self._metrics(self._over_ranks(sums), float(len(self.held)))
