"""Byte offsets and summaries of a trajectories JSONL file, from one streaming pass.

A `FileIndex` remembers where each complete line starts and a small summary of it (what the
episode list shows and filters on); the record itself is read back by its offset when a page
asks for it. A file that grows (a live proxy's export, a step being written) is indexed from
where the last pass stopped; a file replaced atomically (a new inode) is indexed again. A last
line without its newline is a line still being written: it is left for the next pass.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Summary = dict[str, Any]
"""One line's summary (JSON-ready): see `summarize`."""

_BOOKKEEPING = frozenset({
    "prompt_index", "sample_index", "seed", "turn", "segment", "segments", "drift_events",
    "episode", "calls", "choices", "session_id", "segment_cause",
})
"""Info keys that are not parts of a reward (the rollout's and the proxy's bookkeeping)."""


def reward_parts(info: dict[str, Any]) -> dict[str, float]:
    """The numbers an environment or reward function put in `info` (a dict reward's extra keys
    go there: `agentrl.rewards`), bookkeeping left out."""
    return {k: float(v) for k, v in info.items()
            if k not in _BOOKKEEPING and isinstance(v, int | float) and not isinstance(v, bool)}


def drift_of(info: dict[str, Any]) -> bool:
    """Whether the episode saw drift: the env's bridge reports it in `info["drift"]` and counts
    it in `info["drift_events"]`; the proxy marks a segment started by it (`agentrl.segments`)."""
    return bool(info.get("drift") or info.get("drift_events")
                or info.get("segment_cause") == "drift")


def discard_reason(record: dict[str, Any]) -> str:
    info = record.get("info") or {}
    for key in ("error", "export_error", "store_errors"):
        if info.get(key):
            return str(info[key])[:500]
    return "discarded (no reason recorded)"


def summarize(record: dict[str, Any], line: int) -> Summary:
    """What the episode list shows of a record, and what its filters read."""
    info = record.get("info")
    info = info if isinstance(info, dict) else {}
    turns = record.get("turns") or []
    versions = [int(t.get("policy_version", 0)) for t in turns]
    versions += [int(v) for t in turns for _, v in t.get("version_changes", ())]
    discard = bool(record.get("discard"))
    return {
        "line": line,
        "uid": str(record.get("uid", "")),
        "group": record.get("group"),
        "episode": str(info["episode"]) if info.get("episode") is not None
        else f"uid:{record.get('uid')}",
        "segment": int(info.get("segment", 0)),
        "segment_cause": info.get("segment_cause"),
        "reward": float(sum(float(t.get("reward", 0.0)) for t in turns)),
        "turns": len(turns),
        "tokens": len(record.get("token_ids") or ()),
        "policy_tokens": int(sum(record.get("loss_mask") or ())),
        "versions": [min(versions), max(versions)] if versions else None,
        "terminated": bool(record.get("terminated")),
        "truncated": bool(record.get("truncated")),
        "discard": discard,
        "reason": discard_reason(record) if discard else None,
        "drift": drift_of(info),
        "task": str(info.get("task") or info.get("env") or ""),
        "corrupt": None,
    }


def corrupt_summary(path: Path, line: int, error: str) -> Summary:
    return {"line": line, "uid": "", "group": None, "episode": f"corrupt:{line}", "segment": 0,
            "segment_cause": None, "reward": 0.0, "turns": 0, "tokens": 0, "policy_tokens": 0,
            "versions": None, "terminated": False, "truncated": False, "discard": False,
            "reason": None, "drift": False, "task": "",
            "corrupt": f"{path.name}:{line}: {error}"[:500]}


@dataclass
class FileIndex:
    """The offsets and summaries of one JSONL file's complete lines (module docstring)."""

    path: Path
    offsets: list[int] = field(default_factory=list)
    """Start of each indexed non-empty line."""
    summaries: list[Summary] = field(default_factory=list)
    _end: int = 0
    """Bytes indexed so far (the start of the first line not yet indexed)."""
    _lines: int = 0
    _inode: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def refresh(self) -> bool:
        """Index what was added since the last pass (all of it if the file was replaced);
        returns whether anything changed."""
        with self._lock:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                return False
            if st.st_ino != self._inode or st.st_size < self._end:
                self.offsets, self.summaries, self._end, self._lines = [], [], 0, 0
                self._inode = st.st_ino
            if st.st_size == self._end:
                return False
            before = len(self.offsets)
            self._scan()
            return len(self.offsets) != before

    def _scan(self) -> None:
        with self.path.open("rb") as f:
            f.seek(self._end)
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # still being written: the next pass takes it whole
                start, self._end = self._end, self._end + len(raw)
                self._lines += 1
                if not raw.strip():
                    continue
                self.offsets.append(start)
                self.summaries.append(self._summary(raw, self._lines))

    def _summary(self, raw: bytes, line: int) -> Summary:
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or "turns" not in record:
                raise ValueError("not a trajectory record (no \"turns\")")
            return summarize(record, line)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            return corrupt_summary(self.path, line, f"{type(e).__name__}: {e}")

    def __len__(self) -> int:
        return len(self.offsets)

    def read(self, i: int) -> dict[str, Any]:
        """The record of indexed line `i` (0-based among the non-empty lines), read by offset.
        Raises ValueError for a corrupt line, with its file and line."""
        if not 0 <= i < len(self.offsets):
            raise IndexError(f"{self.path.name} has {len(self.offsets)} records, not {i + 1}")
        if self.summaries[i]["corrupt"]:
            raise ValueError(self.summaries[i]["corrupt"])
        with self.path.open("rb") as f:
            f.seek(self.offsets[i])
            return json.loads(f.readline())

    def position(self, line: int) -> int:
        """The index of the record on file line `line` (1-based), as the pages name records."""
        lo, hi = 0, len(self.summaries)
        while lo < hi:  # summaries are in line order
            mid = (lo + hi) // 2
            if self.summaries[mid]["line"] < line:
                lo = mid + 1
            else:
                hi = mid
        if lo == len(self.summaries) or self.summaries[lo]["line"] != line:
            raise KeyError(f"{self.path.name} has no record on line {line}")
        return lo
