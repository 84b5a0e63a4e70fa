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

The update is the RL trainer's machinery: the same backends (`--backend`), packing, log-prob
function (`trainers.logprobs.token_logprobs`), checkpoints (`--save_every`, `--resume`),
metrics (metrics.jsonl, TensorBoard, W&B; `agentrl plot`) and progress bar. The loss is the
mean negative log-likelihood per target token of each optimizer step
(`agentrl.algorithms.preference.sft_loss`); the held-out split's is reported as `eval/loss`.
One process: the distributed backends run as one rank here.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainers.config import _DEFER, ActorConfig, deferred_validation

_SFT_LR = 1e-5


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """`agentrl sft` flags."""

    dataset: str | None = None
    """Chat data: a .jsonl, .json or .parquet file or a `datasets` save_to_disk directory. A
    row holds a conversation under --messages_key (OpenAI-style messages; the assistant turns
    are trained), or a prompt and a response under --prompt_key and --response_key."""
    eval_dataset: str | None = None
    """Held-out chat data (default: --eval_fraction of --dataset, picked by content hash)."""
    eval_fraction: float = 0.05
    """Share of --dataset held out for eval/loss when there is no --eval_dataset."""
    trajectories: str | None = None
    """Train on agentrl trajectories instead: a .jsonl file or a directory of them (a run's
    rollouts/, `agentrl rollout` output, a proxy's exported sessions)."""
    min_reward: float | None = None
    """With --trajectories: keep only episodes whose total reward is at least this (rejection
    sampling fine-tuning)."""
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    response_key: str = "response"
    bad_rows: Literal["stop", "skip"] = "stop"
    """A row that is not JSON or lacks its keys: stop with its line number, or skip and count."""
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(lr=_SFT_LR))
    backend: str = "auto"
    """Training backend (agentrl/backends): local, cpu, fsdp2, deepspeed or auto."""
    epochs: int = 1
    max_steps: int = 0
    """Stop after this many optimizer steps (0: after --epochs)."""
    batch_size: int = 16
    """Sequences per optimizer step."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass (gradients accumulate over a step)."""
    max_len: int = 2048
    """Longer sequences are cut to this many tokens (counted in `truncated`)."""
    packing: bool = True
    """Concatenate a micro-batch's sequences into one, without padding."""
    eval_every: int = 0
    """Also report eval/loss every N steps (it is always reported before and after)."""
    save_every: int = 0
    """Save a checkpoint every N steps (one is always saved at the end)."""
    keep_last: int = 2
    resume: str | None = None
    """A checkpoint directory, or `auto` for the run directory's latest."""
    seed: int = 0
    run_dir: str = "runs/sft"
    tensorboard: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if _DEFER.get():
            return
        if (self.dataset is None) == (self.trajectories is None):
            raise ValueError("give --dataset (chat data) or --trajectories (agentrl "
                             "trajectories), one of the two")
        if self.min_reward is not None and self.trajectories is None:
            raise ValueError("--min_reward filters --trajectories by their reward; chat data "
                             "has none")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"--eval_fraction must be in [0, 1), got {self.eval_fraction}")
        for name in ("epochs", "batch_size", "micro_batch_size", "max_len", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps < 0 or self.eval_every < 0 or self.save_every < 0:
            raise ValueError("--max_steps, --eval_every and --save_every must be >= 0")


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
        m = messages[i]
        if m.get("tool_calls"):
            raise ValueError(f"{where}: assistant messages with tool_calls are not supported "
                             f"in chat data yet; train on the agent's trajectories "
                             f"(--trajectories) instead")
        content = m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"{where}: assistant message {i} has no text content")  # noqa: TRY004
        action = bridge.action_ids(content)
        builder.add_action(action, None)
        j = i + 1
        while j < len(messages) and messages[j].get("role") != "assistant":
            j += 1
        if j < len(messages):  # more assistant turns: what comes between is an observation
            builder.add_observation(bridge.observation_ids(action, messages[i + 1 : j]))
        i = j
    return builder.build(terminated=True, truncated=False)


def _messages(row: dict, cfg: SFTConfig, where: str) -> list[dict]:
    if cfg.messages_key in row:
        messages = row[cfg.messages_key]
        if not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
            raise ValueError(f"{where}: {cfg.messages_key!r} must be a list of messages")
        return messages
    prompt, response = row[cfg.prompt_key], row[cfg.response_key]
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise ValueError(  # noqa: TRY004 (reported as a bad row, like the others)
            f"{where}: {cfg.prompt_key!r} and {cfg.response_key!r} must be text")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def _held_out(row: dict, fraction: float) -> bool:
    digest = hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


@dataclass
class SFTData:
    train: list[Any]
    eval: list[Any]
    skipped: int = 0
    truncated: int = 0


def load_sft_data(cfg: SFTConfig, tokenizer: Any) -> SFTData:
    """Every example, tokenized and checked, before any model loads."""
    if cfg.trajectories is not None:
        return _trajectory_data(cfg)
    from agentrl.data import read_rows
    from agentrl.envs.template import ChatTemplateBridge

    bridge = ChatTemplateBridge(tokenizer)
    out = SFTData([], [])
    sources = [(cfg.dataset, False)] + ([(cfg.eval_dataset, True)] if cfg.eval_dataset else [])
    for path, is_eval in sources:
        assert path is not None
        rows = read_rows(path, on_bad=cfg.bad_rows, what="--eval_dataset" if is_eval
                         else "--dataset")
        out.skipped += len(rows.skipped)
        for row, where in zip(rows.rows, rows.where, strict=True):
            try:
                if cfg.messages_key not in row and not (
                        cfg.prompt_key in row and cfg.response_key in row):
                    raise ValueError(
                        f"{where}: no {cfg.messages_key!r} key, nor {cfg.prompt_key!r} and "
                        f"{cfg.response_key!r} (it has {sorted(row)[:12]}); name the columns "
                        f"with --messages_key or --prompt_key/--response_key")
                traj = chat_trajectory(bridge, _messages(row, cfg, where), where)
            except ValueError as e:
                if cfg.bad_rows == "stop":
                    raise ValueError(f"{e} (skip such rows with --bad_rows skip)") from None
                out.skipped += 1
                continue
            held = is_eval or (not cfg.eval_dataset and _held_out(row, cfg.eval_fraction))
            (out.eval if held else out.train).append(traj)
    if not out.train:
        raise ValueError(f"--dataset {cfg.dataset}: no training examples left (all held out "
                         f"or skipped); lower --eval_fraction or fix the rows")
    out.truncated = _truncate(out.train + out.eval, cfg.max_len)
    return out


def _trajectory_data(cfg: SFTConfig) -> SFTData:
    from agentrl.types import iter_jsonl

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
        (held if _held_out({"uid": t.uid}, cfg.eval_fraction) else train).append(t)
    if not train:
        train, held = held, []
    out = SFTData(train, held, skipped=dropped)
    out.truncated = _truncate(out.train + out.eval, cfg.max_len)
    return out


def _truncate(trajs: list[Any], max_len: int) -> int:
    """Cut sequences to `max_len` tokens (turns past the cut are dropped); returns how many."""
    from agentrl.types import Turn

    cut = 0
    for t in trajs:
        if len(t.token_ids) <= max_len:
            continue
        cut += 1
        t.token_ids, t.loss_mask = t.token_ids[:max_len], t.loss_mask[:max_len]
        t.logprobs = t.logprobs[:max_len]
        t.turns = [Turn(obs_start=x.obs_start, start=x.start, end=min(x.end, max_len),
                        reward=x.reward, policy_version=x.policy_version,
                        finish_reason="length" if x.end > max_len else x.finish_reason)
                   for x in t.turns if x.start < max_len]
        t.images = [im for im in t.images if im.end <= max_len]
    return cut


# ---------------------------------------------------------------------- training


class SFTTrainer:
    """One model behind one backend, trained on SFTData by steps of --batch_size sequences."""

    def __init__(self, cfg: SFTConfig, data: SFTData, tokenizer: Any) -> None:
        import torch

        from agentrl.backends import (
            DistSpec,
            OptimizerSpec,
            create_backend,
            resolve_backend_name,
            resolve_device,
        )
        from agentrl.models import load_model
        from trainers.config import TrainConfig

        torch.manual_seed(cfg.seed)
        self.cfg, self.data, self.tokenizer = cfg, data, tokenizer
        a = cfg.actor
        self.device = resolve_device(a.device)
        self.model = load_model(a.model, dtype=a.dtype).train()
        if a.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.backend = create_backend(resolve_backend_name(cfg.backend, self.device), DistSpec())
        self.backend.setup(self.model, OptimizerSpec(
            lr=a.lr, betas=a.betas, weight_decay=a.weight_decay, warmup_steps=a.warmup_steps,
            max_grad_norm=a.max_grad_norm), self.device)
        # The log-prob function's settings, as the RL trainer passes them.
        self.tcfg = TrainConfig(actor=a, backend=cfg.backend, packing=cfg.packing,
                                share_prefixes=False, micro_batch_size=cfg.micro_batch_size,
                                use_ray=False, seed=cfg.seed)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id)
        per_epoch = math.ceil(len(data.train) / cfg.batch_size)
        self.total_steps = cfg.max_steps or per_epoch * cfg.epochs
        self.step, self.epoch, self.pos = 0, 0, 0
        self.order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.data.train)))
        random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _next_batch(self) -> list[Any]:
        """The next --batch_size examples of the epoch's shuffled order (an epoch's last step
        may be shorter: steps never mix two epochs)."""
        if self.pos >= len(self.order):
            self.epoch += 1
            self.order, self.pos = self._epoch_order(self.epoch), 0
        take = self.order[self.pos : self.pos + self.cfg.batch_size]
        self.pos += len(take)
        return [self.data.train[i] for i in take]

    def _batch(self, trajs: list[Any]) -> Any:
        from trainers.batch import collate

        return collate(trajs, self.pad_id).to(self.device)

    def _micro_batches(self, batch: Any) -> Any:
        from trainers.batch import length_sorted

        return batch.micro_batches(length_sorted(batch, range(batch.size)),
                                   self.cfg.micro_batch_size)

    def train_step(self) -> dict[str, float]:
        from agentrl.algorithms.preference import sft_loss
        from trainers.logprobs import token_logprobs

        t0 = time.perf_counter()
        batch = self._batch(self._next_batch())
        num_tokens = float(batch.mask.sum())

        def loss_fn(module: Any, rows: Any) -> tuple[Any, dict[str, float]]:
            logp, _, _ = token_logprobs(self.tcfg, self.backend, module, batch, rows)
            idx, n = rows
            loss = sft_loss(logp, batch.mask[idx, : n - 1], num_tokens)
            return loss, {"loss": float(loss.detach())}

        total = 0.0
        for rows in self._micro_batches(batch):
            total += self.backend.forward_backward(rows, loss_fn)["loss"]
        stats = self.backend.optimizer_step()
        self.step += 1
        return {"loss": total, "tokens": num_tokens, "sequences": float(batch.size),
                "epoch": float(self.epoch), "time_step": time.perf_counter() - t0, **stats}

    def eval_loss(self) -> float | None:
        """Mean negative log-likelihood per target token of the held-out split."""
        import torch

        from trainers.logprobs import token_logprobs

        if not self.data.eval:
            return None
        nll = count = 0.0
        with torch.no_grad():
            for i in range(0, len(self.data.eval), self.cfg.batch_size):
                batch = self._batch(self.data.eval[i : i + self.cfg.batch_size])
                for rows in self._micro_batches(batch):
                    logp, _, _ = token_logprobs(self.tcfg, self.backend, self.backend.module,
                                                batch, rows)
                    idx, n = rows
                    mask = batch.mask[idx, : n - 1]
                    nll -= float((logp * mask).sum())
                    count += float(mask.sum())
        return nll / max(count, 1.0)

    # ---------------------------------------------------------------- checkpoints
    def save(self) -> Path:
        from trainers.checkpoint import rng_state, save_checkpoint

        state = {"backend": self.backend.state_dict(), "rng": rng_state()}
        trainer = {"step": self.step, "epoch": self.epoch, "pos": self.pos,
                   "order": self.order, "kind": "sft"}
        return save_checkpoint(self.cfg.run_dir, self.step, state, trainer,
                               keep=self.cfg.keep_last)

    def restore(self, path: Path) -> None:
        from trainers.checkpoint import load_checkpoint, set_rng_state

        state, trainer, _ = load_checkpoint(path)
        if trainer.get("kind") != "sft":
            raise ValueError(f"{path} is not an `agentrl sft` checkpoint")
        self.backend.load_state_dict(state["backend"])
        set_rng_state(state["rng"])
        self.step, self.epoch, self.pos = trainer["step"], trainer["epoch"], trainer["pos"]
        self.order = list(trainer["order"])

    def export_hf(self, path: Path) -> None:
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def run_sft(cfg: SFTConfig) -> dict[str, Any]:
    from agentrl.models import load_tokenizer
    from trainers.checkpoint import latest_checkpoint
    from trainers.metrics import MetricsLogger

    tokenizer = load_tokenizer(cfg.actor.model)
    data = load_sft_data(cfg, tokenizer)
    run_dir = Path(cfg.run_dir)
    resume = None
    if cfg.resume is not None:
        resume = latest_checkpoint(run_dir) if cfg.resume == "auto" else Path(cfg.resume)
        if resume is None:
            raise ValueError(f"--resume auto: no checkpoint in {run_dir}/checkpoints")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
    trainer = SFTTrainer(cfg, data, tokenizer)
    if resume is not None:
        trainer.restore(resume)
    log = MetricsLogger(run_dir, tensorboard=cfg.tensorboard, total_steps=trainer.total_steps,
                        progress=cfg.progress, config=asdict(cfg))
    summary: dict[str, Any] = {"run_dir": str(run_dir), "train_examples": len(data.train),
                               "eval_examples": len(data.eval), "skipped": data.skipped,
                               "truncated": data.truncated}
    try:
        before = trainer.eval_loss()
        if before is not None and resume is None:
            log.log(0, {"eval/loss": before})
            summary["eval_loss_before"] = before
        while trainer.step < trainer.total_steps:
            metrics = trainer.train_step()
            if cfg.eval_every and trainer.step % cfg.eval_every == 0:
                value = trainer.eval_loss()
                if value is not None:
                    metrics["eval/loss"] = value
            log.log(trainer.step, metrics)
            log.progress(trainer.step, metrics)
            if cfg.save_every and trainer.step % cfg.save_every == 0:
                trainer.save()
        after = trainer.eval_loss()
        if after is not None:
            log.log(trainer.step, {"eval/loss": after})
            summary["eval_loss_after"] = after
        summary["checkpoint"] = str(trainer.save())
        trainer.export_hf(run_dir / "hf")
        summary["hf_model"] = str(run_dir / "hf")
        summary["steps"] = trainer.step
    finally:
        log.close()
    return summary


def main(argv: list[str]) -> int:
    import tyro

    from trainers.cli import bool_values, quiet_third_party

    try:
        with deferred_validation():  # checked once, with the flags applied
            cfg = tyro.cli(SFTConfig, args=bool_values(argv), prog="agentrl sft",
                           description=__doc__, config=(tyro.conf.FlagConversionOff,),
                           use_underscores=True)
        cfg.actor.__post_init__()
        cfg.__post_init__()
    except ValueError as e:
        print(f"agentrl sft: {e}", file=sys.stderr)
        return 2
    quiet_third_party()
    try:
        summary = run_sft(cfg)
    except ValueError as e:
        print(f"agentrl sft: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0
