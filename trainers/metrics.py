"""Metrics: a JSON-lines file always, TensorBoard when available, a progress bar on stderr."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, total_steps: int = 0,
                 progress: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tb"))
            except ImportError:  # tensorboard is optional at run time
                self._tb = None
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="train", unit="step", file=sys.stderr,
                             dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: _num(v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, int | float):
                    self._tb.add_scalar(k.replace("@", "_at_"), v, step)

    def progress(self, step: int, metrics: dict[str, Any]) -> None:
        if self._bar is None:
            return
        self._bar.n = step
        shown = {k: metrics[k] for k in ("reward", "kl", "entropy", "time_step") if k in metrics}
        self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def _num(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
