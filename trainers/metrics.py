"""Metrics: a JSON-lines file always, TensorBoard when available, Weights & Biases when asked
for (WANDB_API_KEY set, or WANDB_MODE=online after `wandb login`, or WANDB_MODE=offline, which
needs no key and writes the run under RUN_DIR/wandb for a later `wandb sync`), a progress bar on
stderr."""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, total_steps: int = 0,
                 progress: bool = True, config: dict | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # W&B first: a bad WANDB_MODE fails here, before any file or writer is open.
        self._wandb = _start_wandb(Path(run_dir), config or {})
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
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if isinstance(v, int | float)},
                            step=step)

    def progress(self, step: int, metrics: dict[str, Any]) -> None:
        if self._bar is None:
            return
        self._bar.n = step
        shown = {k: metrics[k] for k in ("reward", "kl", "teacher_kl", "entropy", "time_step")
                 if k in metrics}
        self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()


# WANDB_MODE values wandb.init accepts (wandb_settings.Settings.mode); "dryrun" is "offline" and
# "run" is "online" under their old names.
_WANDB_MODES = ("online", "offline", "dryrun", "run", "shared", "disabled")


def _start_wandb(run_dir: Path, config: dict) -> Any:
    """A W&B run when WANDB_API_KEY is set or WANDB_MODE names a mode other than "disabled";
    None otherwise, and a warning (not a crash) if wandb is missing. Offline mode needs no key or
    network: the run is written to RUN_DIR/wandb (or WANDB_DIR) for `wandb sync` to upload."""
    mode = os.environ.get("WANDB_MODE", "")  # as wandb.init reads it: no case folding
    if mode and mode not in _WANDB_MODES:
        close = difflib.get_close_matches(mode.strip().lower(), _WANDB_MODES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"WANDB_MODE={mode!r} is not a W&B mode{hint}: set it to offline (no "
                         f"key needed), online or disabled, or unset it")
    if mode == "disabled" or not (mode or os.environ.get("WANDB_API_KEY")):
        return None
    try:
        import wandb
    except ImportError:
        logger.warning("W&B logging was asked for (WANDB_API_KEY or WANDB_MODE) but wandb is not "
                       "installed (pip install wandb); metrics go to metrics.jsonl and TensorBoard "
                       "only")
        return None
    # WANDB_DIR, when the user sets it, wins over the run directory (wandb.init reads it itself).
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "agentrl"), name=run_dir.name,
                      dir=None if os.environ.get("WANDB_DIR") else str(run_dir), config=config)


def _num(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
