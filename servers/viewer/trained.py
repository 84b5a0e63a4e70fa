"""The trainer's side of a step (`RUN_DIR/trained/step_N.jsonl`, `agentrl.trained_files`): its
lines indexed by the rollouts line each names, read back by offset when a turn is shown.

Read only when a page needs a step's advantages or a turn, and again when the file changed. A
line that is not a trained record (a file cut short, edited, or not the trainer's) is named
with its file and line, and the turns it would have covered say so; the rest of the file and
the rollouts show as they are.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.trained_files import aligned

Aligned = tuple[list[float | None], list[float | None]]
"""Trainer log-probs and advantages aligned with a record's `token_ids` (None: not trained)."""


@dataclass
class TrainedIndex:
    """One step's trained file (module docstring)."""

    path: Path
    offsets: dict[int, int] = field(default_factory=dict)
    """Rollouts line -> where its trained line starts."""
    advantages: dict[int, float] = field(default_factory=dict)
    """Rollouts line -> the mean of its advantages (for a group estimator, the episode's)."""
    errors: list[str] = field(default_factory=list)
    """`file:line: what` of each line that is not a trained record."""
    _stamp: tuple[int, int, int] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def refresh(self) -> bool:
        """Index the file again if it changed; returns whether it exists."""
        with self._lock:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                self.offsets, self.advantages, self.errors, self._stamp = {}, {}, [], None
                return False
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp != self._stamp:
                self._scan()
                self._stamp = stamp
            return True

    def _scan(self) -> None:
        self.offsets, self.advantages, self.errors = {}, {}, []
        offset = 0
        with self.path.open("rb") as f:
            for n, raw in enumerate(f, 1):
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                try:
                    if not raw.endswith(b"\n"):
                        raise ValueError("cut short (no end of line)")
                    line, adv = _line_and_advantage(json.loads(raw))
                except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
                    self.errors.append(f"{self.path.name}:{n}: {type(e).__name__}: {e}"[:500])
                    continue
                self.offsets[line] = start
                if adv is not None:
                    self.advantages[line] = adv

    def lookup(self, line: int, record: dict[str, Any]) -> tuple[Aligned | None, str]:
        """The trainer's values for the rollout `record` on `line`, aligned with its tokens, or
        None with why not."""
        if not self.refresh():
            return None, "this step has no trainer's file (trained/): no mismatch recorded"
        if line not in self.offsets:
            if self.errors:
                return None, (f"no trainer's line for this episode; the trainer's file has "
                              f"{len(self.errors)} unreadable line(s), the first "
                              f"{self.errors[0]}")
            return None, "the step did not train on this episode (discarded or filtered out)"
        with self.path.open("rb") as f:
            f.seek(self.offsets[line])
            raw = f.readline()
        try:
            return aligned(json.loads(raw), record), ""
        except (ValueError, TypeError) as e:
            return None, f"the trainer's line for this episode does not fit it: {e}"[:500]


def _line_and_advantage(row: Any) -> tuple[int, float | None]:
    if not isinstance(row, dict) or not isinstance(row.get("line"), int):
        raise TypeError('not a trained record (no "line")')
    advantages = row.get("advantages")
    if not isinstance(advantages, list):
        raise TypeError('not a trained record (no "advantages")')
    values = [float(a) for a in advantages if isinstance(a, int | float)]
    values = [a for a in values if math.isfinite(a)]
    return row["line"], (sum(values) / len(values) if values else None)
