"""`agentrl plot RUN_DIR`: PNG curves of a run's metrics.jsonl (reward, KL, entropy, ...)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

from agentrl.command_line import parse_flags

DEFAULT_KEYS = ("reward", "eval/pass@1", "eval/mean_return", "kl", "entropy", "clip_ratio",
                "mismatch", "response_tokens", "tokens_per_s", "time_step")


def load_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist; pass the run directory of `agentrl train`")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path, keys: tuple[str, ...] = DEFAULT_KEYS) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for key in keys:
        # A held-out metric's curve runs from the eval before training (and the one after a
        # warm-up, at step 0 too) through the periodic ones (--eval_every) to the eval after it.
        names = (f"eval_before/{key[5:]}", f"eval_warmup/{key[5:]}", key,
                 f"eval_after/{key[5:]}") if key.startswith("eval/") else (key,)
        pts = [(r["step"], r[name]) for r in rows for name in names
               if isinstance(r.get(name), int | float)]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        ax.plot(*zip(*pts, strict=True), marker="o", markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{key.replace('/', '_')}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


@dataclass(frozen=True, kw_only=True)
class PlotArgs:
    run_dir: tyro.conf.Positional[str]
    """The run directory (it holds metrics.jsonl)."""
    keys: tuple[str, ...] = DEFAULT_KEYS
    """The metrics to plot, one PNG each (a metric the run did not log is skipped)."""


def main(argv: list[str]) -> int:
    args = parse_flags(PlotArgs, argv, prog="agentrl plot", doc=__doc__)
    try:
        paths = plot_run(args.run_dir, tuple(args.keys))
    except ValueError as e:
        print(f"agentrl plot: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0
