"""What the trained/ file (`agentrl/trained_files.py`, #35 item 2) costs a training step: the
digits preset (tiny model, colocated, no Ray), with the file's extra work timed directly
against the logged `time_step`: `trainers.batch.per_token` in the worker (the trainer's
log-probs and advantages read off the batch) and `Trainer._save_trained` in the driver (the
call for the records, the join to the rollouts' lines, the atomic write). Prints one JSON line.

    python benchmarks/trained_file_cost.py --steps 20 --max_new_tokens 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import cpu_description  # benchmarks/machine.py

import trainers.policy as policy_module
from trainers.controller import Trainer
from trainers.presets import digits


def timed(fn: Any, into: dict[str, float], key: str) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[key] += time.perf_counter() - t0

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    args = parser.parse_args()
    spent = {"per_token": 0.0, "save_trained": 0.0}
    policy_module.per_token = timed(policy_module.per_token, spent, "per_token")
    Trainer._save_trained = timed(Trainer._save_trained, spent, "save_trained")  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cfg = digits()
        cfg = dataclasses.replace(
            cfg, run_dir=str(run), use_ray=False, progress=False, tensorboard=False,
            steps=args.steps, eval_problems=0,
            rollout=dataclasses.replace(cfg.rollout, max_new_tokens=args.max_new_tokens))
        Trainer(cfg).run()
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r["time_step"] for r in rows if "time_step" in r]
        files = sorted((run / "trained").glob("*.jsonl"))
        tokens = sum(len(json.loads(x)["trainer_logprobs"])
                     for f in files for x in f.read_text().splitlines())
        size = sum(f.stat().st_size for f in files)
    n = len(steps)
    print(json.dumps({
        "machine": cpu_description(), "steps": n, "max_new_tokens": args.max_new_tokens,
        "time_step_mean_s": round(sum(steps) / n, 4),
        "per_token_ms_per_step": round(1e3 * spent["per_token"] / n, 3),
        "save_trained_ms_per_step": round(1e3 * spent["save_trained"] / n, 3),
        "share_of_step": round(sum(spent.values()) / sum(steps), 5),
        "trained_tokens_per_step": tokens / n, "trained_file_bytes_per_step": size / n,
    }))


if __name__ == "__main__":
    main()
