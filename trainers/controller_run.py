"""Runs a TrainConfig and prints the outcome (separate from cli.py so tests can call it)."""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.rollout.evaluate import format_interval
from trainers.config import TrainConfig


def run(cfg: TrainConfig) -> int:
    """Train; exit codes: 0 done, 1 stopped by an error (checkpoint kept), 2 bad flags, 143
    stopped by SIGTERM (between steps, with a checkpoint). Ray is shut down before returning,
    so no helper process outlives the command."""
    from agentrl.sandbox import SandboxUnavailableError
    from trainers.controller import StopRequested, Trainer
    from trainers.ray_utils import shutdown_ray
    from trainers.workers import TrainingError

    trainer = Trainer(cfg)
    restore: list[Callable[[], None]] = []
    # After the workers start: ray.init installs a SIGTERM handler of its own (it exits 15).
    trainer.on_started.append(lambda: restore.append(_stop_on_sigterm(trainer)))
    try:
        summary = trainer.run()
    except StopRequested as e:
        print(f"agentrl train: {e}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except (TrainingError, SandboxUnavailableError) as e:  # the latter says how to fix it
        # A Ray worker's error is re-raised as its class too; `cause` is it without Ray's trace.
        print(f"agentrl train: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return 1
    except ValueError as e:  # a flag that does not fit the machine (checked before loading)
        print(f"agentrl train: {e}", file=sys.stderr)
        return 2
    finally:
        for undo in restore:
            undo()
        shutdown_ray()
    print(json.dumps(summary, indent=2))
    if "eval_change" in summary:
        print(eval_report(summary))
        by_task = task_report(summary)
        if by_task:
            print(by_task)
    return 0


def eval_report(summary: dict[str, Any]) -> str:
    """One line a reader can judge: what was evaluated, pass@1 before and after with 95%
    intervals, and the change on the same problems with its own interval."""
    before, after, change = summary["eval_before"], summary["eval_after"], summary["eval_change"]
    setting = dict(change["setting"])
    what = ", ".join(f"{k} {v}" for k, v in setting.items()
                     if k not in ("env", "problems", "samples_per_problem", "temperature"))
    warm = summary.get("eval_warmup")
    warmed = (f"after the warm-up {warm['pass@1']:.3f} {_bounds(warm)}, " if warm else "")
    return (
        f"held-out pass@1 on {setting['env']} ({what + '; ' if what else ''}"
        f"{after['num_problems']} problems x "
        f"{setting['samples_per_problem']} samples = {after['num_samples']}, T="
        f"{setting['temperature']}): before {before['pass@1']:.3f} {_bounds(before)}, {warmed}"
        f"after {after['pass@1']:.3f} {_bounds(after)}, change {change['pass@1']:+.3f} +- "
        f"{change['ci95']:.3f} (95% intervals: Wilson's for pass@1, paired for the change)"
    )


def task_report(summary: dict[str, Any]) -> str:
    """Held-out pass@1 before and after for each task, with 95% Wilson intervals over the
    task's problems, for envs that name an episode's task (MiniWoB-v0; `score_by_task`), read
    from the run's eval_before/eval_after.jsonl; "" for envs with one task or none."""
    from agentrl.rollout.evaluate import score_by_task
    from agentrl.trajectory_files import load_jsonl

    run = Path(summary["run_dir"])
    paths = [run / f"{name}.jsonl" for name in ("eval_before", "eval_after")]
    if not all(p.exists() for p in paths):
        return ""
    k = int(summary["eval_change"]["setting"]["samples_per_problem"])
    before, after = (score_by_task(load_jsonl(p), k) for p in paths)
    warm_path = run / "eval_warmup.jsonl"
    warm = score_by_task(load_jsonl(warm_path), k) if warm_path.exists() else {}
    tasks = [t for t in after if t in before]
    if len(tasks) < 2:
        return ""
    width = max(len(t) for t in tasks)

    def rate(name: str, r: Any) -> str:
        return f"{name} {r.pass_at_1:.3f} {format_interval(r.pass_at_1_interval)}, "

    lines = [f"  {t:<{width}}  {rate('before', before[t])}"
             f"{rate('after the warm-up', warm[t]) if t in warm else ''}"
             f"{rate('after', after[t])[:-2]} on {after[t].num_problems} problems"
             for t in tasks]
    head = "held-out pass@1 per task (95% Wilson intervals over each task's problems):"
    return "\n".join([head, *lines])


def _bounds(result: dict[str, Any]) -> str:
    return format_interval((result["pass@1_low"], result["pass@1_high"]))


def _stop_on_sigterm(trainer: Any) -> Callable[[], None]:
    """Make SIGTERM (a scheduler's stop, `kill`) end the run after the current step with a
    checkpoint; a second SIGTERM acts at once. Returns what restores the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        trainer.request_stop("SIGTERM")
        signal.signal(signal.SIGTERM, previous)

    previous = signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore
