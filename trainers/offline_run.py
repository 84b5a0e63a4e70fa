"""The offline trainers' (`agentrl sft`, `agentrl dpo`, `agentrl rm`) run loop and command
entry. What they share: their common flags (trainers/offline_config.py), their examples, read
and checked before any model loads (trainers/offline_data.py), one model behind one training
backend (trainers/offline_trainer.py), steps over a shuffled dataset, held-out evaluation
(before, every --eval_every steps and after), checkpoints with exact resume (--resume), metrics
(MetricsLogger: metrics.jsonl, TensorBoard, W&B; `agentrl plot`), a progress bar and the final
Hugging Face export.

`--num_workers N` (with `--backend fsdp2` or `deepspeed`) trains data-parallel in N Ray actors
(trainers/offline_ranks.py), which the loop drives as it drives one trainer: losses are
normalised by global counts, so N ranks make the update of one process, and rank 0 writes the
checkpoints and the export.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from trainers.offline_config import OfflineConfig
from trainers.offline_data import OfflineData
from trainers.offline_ranks import RankGroup
from trainers.offline_trainer import OfflineTrainer

C = TypeVar("C", bound="OfflineConfig")


def resume_point(cfg: OfflineConfig) -> Path | None:
    from trainers.checkpoint import latest_checkpoint

    if cfg.resume is None:
        return None
    found = latest_checkpoint(cfg.run_dir) if cfg.resume == "auto" else Path(cfg.resume)
    if found is None:
        raise ValueError(f"--resume auto: no checkpoint in {cfg.run_dir}/checkpoints")
    return found


def run_offline(cfg: OfflineConfig, trainer: OfflineTrainer | RankGroup, resume: Path | None,
                summary: dict[str, Any]) -> dict[str, Any]:
    """Train to the end, evaluating before, every --eval_every steps and after; returns the
    summary with the evaluations, the last checkpoint and the exported model."""
    from trainers.metrics import MetricsLogger

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
    if resume is not None:
        trainer.restore(resume)
    log = MetricsLogger(run_dir, tensorboard=cfg.tensorboard, total_steps=trainer.total_steps,
                        progress=cfg.progress, config=asdict(cfg))
    try:
        if resume is None:
            before = {f"eval/{k}": v for k, v in trainer.evaluate().items()}
            if before:
                log.log(0, before)
                summary["eval_before"] = before
        while trainer.step < trainer.total_steps:
            metrics = trainer.advance()
            if cfg.eval_every and trainer.step % cfg.eval_every == 0:
                metrics.update({f"eval/{k}": v for k, v in trainer.evaluate().items()})
            log.log(trainer.step, metrics)
            log.progress(trainer.step, metrics)
            if cfg.save_every and trainer.step % cfg.save_every == 0:
                trainer.save()
        after = {f"eval/{k}": v for k, v in trainer.evaluate().items()}
        if after:
            log.log(trainer.step, after)
            summary["eval_after"] = after
        summary["checkpoint"] = str(trainer.save())
        trainer.export_hf(run_dir / "hf")
        summary["hf_model"] = str(run_dir / "hf")
        summary["steps"] = trainer.step
    finally:
        log.close()
    return summary


def train_offline(cfg: C, load: Callable[[C, Any], OfflineData[Any]],
                  trainer: Callable[[C, OfflineData[Any], Any], OfflineTrainer],
                  unit: str) -> dict[str, Any]:
    """Load the data (before any model), build the trainer, train: the summary of the run,
    counting its `unit`s ("examples", "pairs")."""
    from agentrl.models import load_tokenizer

    tokenizer = load_tokenizer(cfg.actor.model)
    data = load(cfg, tokenizer)
    resume = resume_point(cfg)
    summary: dict[str, Any] = {"run_dir": cfg.run_dir, f"train_{unit}": len(data.train),
                               f"eval_{unit}": len(data.eval), "skipped": data.skipped,
                               "truncated": data.truncated}
    if cfg.num_workers == 1:
        return run_offline(cfg, trainer(cfg, data, tokenizer), resume, summary)
    group = RankGroup.start(cfg, trainer, data, tokenizer)
    try:
        return run_offline(cfg, group, resume, summary)
    finally:
        group.close()


def cli_main(config_cls: type[C], run: Callable[[C], dict[str, Any]], prog: str,
             doc: str | None, argv: list[str]) -> int:
    """Parse `argv` into `config_cls` (checked once, with the flags applied), run, print the
    summary; a ValueError is a clear message and exit code 2."""
    from agentrl.command_line import parse_flags
    from trainers.quiet import quiet_third_party

    try:
        cfg = parse_flags(config_cls, argv, prog=prog, doc=doc)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    quiet_third_party()
    try:
        summary = run(cfg)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0
