"""Preference pairs for `agentrl dpo` and `agentrl rm`: a prompt and a chosen and a rejected
reply, read from --dataset rows and tokenized as a rollout's replies.

A row's prompt is text (a user message) or a list of chat messages; `chosen` and `rejected` are
the two replies, as text or as an assistant message (or a one-message list, as conversational
preference datasets store them). Each reply is tokenized as `agentrl sft` tokenizes an
assistant turn (the chat-template bridge: what a policy writing it samples), after the prompt
rendered as an environment renders it. A pair whose replies are the same is a bad row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainers.config import _DEFER
from trainers.offline import OfflineConfig, held_out, truncate
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
        if _DEFER.get():
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


@dataclass
class PairData:
    train: list[Pair]
    eval: list[Pair]
    skipped: int = 0
    truncated: int = 0


def load_pairs(cfg: PairConfig, tokenizer: Any) -> PairData:
    """Every pair, tokenized and checked, before any model loads."""
    from agentrl.data import read_rows
    from agentrl.envs.template import ChatTemplateBridge

    bridge = ChatTemplateBridge(tokenizer)
    keys = {cfg.prompt_key: "--prompt_key", cfg.chosen_key: "--chosen_key",
            cfg.rejected_key: "--rejected_key"}
    if cfg.margin_key is not None:
        keys[cfg.margin_key] = "--margin_key"
    out = PairData([], [])
    sources = [(cfg.dataset, False)] + ([(cfg.eval_dataset, True)] if cfg.eval_dataset else [])
    for path, is_eval in sources:
        assert path is not None
        rows = read_rows(path, keys=keys, on_bad=cfg.bad_rows,
                         what="--eval_dataset" if is_eval else "--dataset")
        out.skipped += len(rows.skipped)
        for row, where in zip(rows.rows, rows.where, strict=True):
            try:
                pair = pair_of(bridge, row, cfg, where)
            except ValueError as e:
                if cfg.bad_rows == "stop":
                    raise ValueError(f"{e} (skip such rows with --bad_rows skip)") from None
                out.skipped += 1
                continue
            held = is_eval or (not cfg.eval_dataset and held_out(row, cfg.eval_fraction))
            (out.eval if held else out.train).append(pair)
    if not out.train:
        raise ValueError(f"--dataset {cfg.dataset}: no training pairs left (all held out or "
                         f"skipped); lower --eval_fraction or fix the rows")
    out.truncated = truncate([t for p in out.train + out.eval for t in (p.chosen, p.rejected)],
                             cfg.max_len)
    return out
