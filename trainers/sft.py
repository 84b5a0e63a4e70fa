"""`agentrl sft`: supervised fine-tuning on chat data or on agentrl's own trajectories.

    agentrl sft --dataset chats.jsonl                         # rows: {"messages": [...]}
    agentrl sft --trajectories runs/math-tir/rollouts --min_reward 1   # rejection sampling

Chat rows become token sequences through the same chat-template bridge the environments use
(`agentrl.envs.template.ChatTemplateBridge`): the conversation up to each assistant turn is
rendered as an env renders it, and each assistant turn is the tokens a policy writing that text
samples (its canonical tokenization and the end-of-turn token), so the tokens trained are the
tokens a rollout produces. The loss is on those assistant tokens only. Trajectories (a run's
`rollouts/`, `agentrl rollout` output, a proxy's `/export`) are trained on exactly their
recorded token ids and loss masks.

The loss is the mean negative log-likelihood per target token of each optimizer step
(`agentrl.algorithms.preference.sft_loss`); the held-out split's is reported as `eval/loss`.
Flags, steps, checkpoints and logging are the offline trainers' (trainers/offline_run.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.command_line import validation_deferred
from trainers.offline_config import OfflineConfig
from trainers.offline_data import OfflineData, held_out, read_examples, truncate
from trainers.offline_run import cli_main, train_offline
from trainers.offline_trainer import OfflineTrainer


@dataclass(frozen=True, kw_only=True)
class SFTConfig(OfflineConfig):
    """`agentrl sft` flags. --dataset rows hold a conversation under --messages_key
    (OpenAI-style messages; the assistant turns are trained), or a prompt and a response."""

    trajectories: str | None = None
    """Train on agentrl trajectories instead of --dataset: a .jsonl file or a directory of
    them (a run's rollouts/, `agentrl rollout` output, a proxy's exported sessions)."""
    min_reward: float | None = None
    """With --trajectories: keep only episodes whose total reward is at least this (rejection
    sampling fine-tuning)."""
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    response_key: str = "response"
    run_dir: str = "runs/sft"

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        super().__post_init__()
        if (self.dataset is None) == (self.trajectories is None):
            raise ValueError("give --dataset (chat data) or --trajectories (agentrl "
                             "trajectories), one of the two")
        if self.min_reward is not None and self.trajectories is None:
            raise ValueError("--min_reward filters --trajectories by their reward; chat data "
                             "has none")


# ---------------------------------------------------------------------- data


def chat_trajectory(bridge: Any, messages: list[dict], where: str = "") -> Any:
    """A conversation as a trajectory: every assistant turn is an action (trained), the rest
    observations, rendered incrementally as an environment renders its turns."""
    from agentrl.types import TrajectoryBuilder

    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise ValueError(f"{where}: a conversation needs a message before its first assistant "
                         f"message, and an assistant message to train on")
    builder = TrajectoryBuilder()
    builder.add_observation(bridge.prompt_ids(messages[:first]))
    i = first
    while i < len(messages):
        action = bridge.action_ids(assistant_text(messages[i], where))
        builder.add_action(action, None)
        j = i + 1
        while j < len(messages) and messages[j].get("role") != "assistant":
            j += 1
        if j < len(messages):  # more assistant turns: what comes between is an observation
            builder.add_observation(bridge.observation_ids(action, messages[i + 1 : j]))
        i = j
    return builder.build(terminated=True, truncated=False)


def assistant_text(message: Any, where: str) -> str:
    """The text of an assistant message that is trained on (a string, or the message)."""
    if isinstance(message, str):
        return message
    if not isinstance(message, dict) or message.get("role", "assistant") != "assistant":
        raise ValueError(f"{where}: expected an assistant message or its text")
    if message.get("tool_calls"):
        raise ValueError(f"{where}: assistant messages with tool_calls are not supported in "
                         f"chat data yet; train on the agent's trajectories (--trajectories)")
    content = message.get("content")
    if not isinstance(content, str):
        raise ValueError(f"{where}: an assistant message has no text content")  # noqa: TRY004
    return content


def _messages(row: dict, cfg: SFTConfig, where: str) -> list[dict]:
    if cfg.messages_key in row:
        messages = row[cfg.messages_key]
        if not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
            raise ValueError(f"{where}: {cfg.messages_key!r} must be a list of messages")
        return messages
    if cfg.prompt_key not in row or cfg.response_key not in row:
        raise ValueError(
            f"{where}: no {cfg.messages_key!r} key, nor {cfg.prompt_key!r} and "
            f"{cfg.response_key!r} (it has {sorted(row)[:12]}); name the columns with "
            f"--messages_key or --prompt_key/--response_key")
    prompt, response = row[cfg.prompt_key], row[cfg.response_key]
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise ValueError(  # noqa: TRY004 (reported as a bad row, like the others)
            f"{where}: {cfg.prompt_key!r} and {cfg.response_key!r} must be text")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def load_sft_data(cfg: SFTConfig, tokenizer: Any) -> OfflineData[Any]:
    """Every example, tokenized and checked, before any model loads."""
    if cfg.trajectories is not None:
        return _trajectory_data(cfg)
    from agentrl.envs.template import ChatTemplateBridge

    bridge = ChatTemplateBridge(tokenizer)
    train, held, skipped = read_examples(
        cfg, lambda row, where: chat_trajectory(bridge, _messages(row, cfg, where), where))
    out = OfflineData[Any](train, held, skipped=skipped)
    out.truncated = truncate(out.train + out.eval, cfg.max_len)
    return out


def _trajectory_data(cfg: SFTConfig) -> OfflineData[Any]:
    from agentrl.trajectory_files import iter_jsonl

    assert cfg.trajectories is not None
    root = Path(cfg.trajectories)
    files = sorted(root.rglob("*.jsonl")) if root.is_dir() else [root]
    if not root.exists() or not files:
        raise ValueError(f"--trajectories {root}: no such file, or no .jsonl files in it")
    kept, dropped = [], 0
    for f in files:
        for traj in iter_jsonl(f):
            below = cfg.min_reward is not None and traj.total_reward < cfg.min_reward
            if traj.discard or not traj.turns or below:
                dropped += 1
            else:
                kept.append(traj)
    if not kept:
        raise ValueError(f"--trajectories {root}: none of its {dropped} trajectories is left to "
                         f"train on" + (f" (none reaches --min_reward {cfg.min_reward})"
                                        if cfg.min_reward is not None else ""))
    train: list[Any] = []
    held: list[Any] = []
    for t in kept:
        (held if held_out({"uid": t.uid}, cfg.eval_fraction) else train).append(t)
    if not train:
        train, held = held, []
    out = OfflineData[Any](train, held, skipped=dropped)
    out.truncated = truncate(out.train + out.eval, cfg.max_len)
    return out


# ---------------------------------------------------------------------- training


class SFTTrainer(OfflineTrainer):
    kind = "sft"

    def __init__(self, cfg: SFTConfig, data: OfflineData[Any], tokenizer: Any,
                 **dist: Any) -> None:
        super().__init__(cfg, data.train, data.eval, tokenizer, **dist)

    def _batch(self, items: list[Any], size: int | None = None) -> tuple[Any, float]:
        """This rank's share of `items` (padded to `size`) as a batch whose padding repeats
        count no tokens, and the number of target tokens over all ranks."""
        import torch

        from agentrl.backends.distributed import all_sum

        mine, weights = self.shard(items, size)
        batch = self.batch(mine)
        batch.mask *= torch.tensor(weights, device=batch.mask.device)[:, None]
        return batch, all_sum([float(batch.mask.sum())])[0]

    def _micro_batches(self, batch: Any) -> Any:
        from trainers.batch import length_sorted

        return batch.micro_batches(length_sorted(batch, range(batch.size)),
                                   self.cfg.micro_batch_size)

    def train_step(self, items: list[Any]) -> dict[str, float]:
        import time

        from agentrl.algorithms.preference import sft_loss
        from agentrl.backends.distributed import all_sum

        t0 = time.perf_counter()
        batch, num_tokens = self._batch(items, self.per_rank)

        def loss_fn(module: Any, rows: Any) -> tuple[Any, dict[str, float]]:
            idx, n = rows
            loss = sft_loss(self.logprobs(module, batch, rows), batch.mask[idx, : n - 1],
                            num_tokens)
            return loss, {"loss": float(loss.detach())}

        total = 0.0
        for rows in self._micro_batches(batch):
            total += self.backend.forward_backward(rows, loss_fn)["loss"]
        stats = self.backend.optimizer_step()
        return {"loss": all_sum([total])[0], "tokens": num_tokens,
                "sequences": float(len(items)), "epoch": float(self.epoch),
                "time_step": time.perf_counter() - t0, **stats}

    def evaluate(self) -> dict[str, float]:
        """Mean negative log-likelihood per target token of the held-out split."""
        import torch

        from agentrl.backends.distributed import all_sum

        if not self.held:
            return {}
        nll = 0.0
        count = 0.0
        with torch.no_grad():
            for i in range(0, len(self.held), self.cfg.batch_size):
                batch, _ = self._batch(self.held[i : i + self.cfg.batch_size])
                for rows in self._micro_batches(batch):
                    idx, n = rows
                    mask = batch.mask[idx, : n - 1]
                    nll -= float((self.logprobs(self.backend.module, batch, rows) * mask).sum())
                    count += float(mask.sum())
        nll, count = all_sum([nll, count])
        return {"loss": nll / max(count, 1.0)}


def run_sft(cfg: SFTConfig) -> dict[str, Any]:
    return train_offline(cfg, load_sft_data, SFTTrainer, "examples")


def main(argv: list[str]) -> int:
    return cli_main(SFTConfig, run_sft, "agentrl sft", __doc__, argv)
