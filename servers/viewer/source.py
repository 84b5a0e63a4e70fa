"""What `agentrl view` shows: a run directory, a trajectories file, a proxy's sessions file or a
live proxy, as a list of steps (each an indexed JSONL file) and the metrics of each step.

- A run directory (`agentrl train`'s run_dir): rollouts/step_NNNNNN.jsonl are the steps,
  trained/step_NNNNNN.jsonl the trainer's side of each (its log-probs and advantages,
  `agentrl.trained_files`; read by `servers.viewer.trained` when a page needs it),
  metrics.jsonl their metrics, config.json the tokenizer (actor.model) and the advantage
  estimator. A run still being written shows the steps written so far; a metrics line still
  being written is left for the next look.
- A trajectories file (`agentrl rollout`, a proxy's /export): one step (a run's rollouts file
  with its trained/ file, where there is one).
- A proxy's SQLite sessions file (`agentrl serve --store`): replayed read-only
  (`servers.durable.read_sessions`) into a trajectories file in the viewer's cache folder, again
  when the store changes.
- A live `agentrl serve` (http://host:port): its /export, fetched again when the page reloads
  and the last fetch is older than `LIVE_REFRESH_S`.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.files import replaced_atomically
from agentrl.trained_files import trained_file_of
from servers.viewer.index import FileIndex
from servers.viewer.trained import TrainedIndex

LIVE_REFRESH_S = 5.0
"""A live proxy's sessions are fetched again at most this often."""

_STEP_FILE = re.compile(r"step_(\d+)\.jsonl$")
WHAT_IS_VIEWED = ("a run directory (with rollouts/ or metrics.jsonl), a trajectories .jsonl "
                  "file, a proxy's sessions .sqlite file, or a proxy's URL (http://host:port)")


@dataclass
class Step:
    """One browsable file: a training step's rollouts, or the whole of a file."""

    key: str
    """How pages name it: the step number, or the file's name."""
    index: FileIndex
    images: Path
    """Where the file's images are stored by hash (`agentrl.trajectory_files.image_dir_of`)."""
    trained: TrainedIndex | None = None
    """The trainer's side of a run's step (its file need not exist); None for what is not a
    run's rollouts file."""


class Source:
    """What is viewed (module docstring). `steps()` and `metrics()` look again at the disk (or
    the proxy) each time, so a run being written shows its new steps on reload."""

    def __init__(self, target: str, *, cache_dir: Path) -> None:
        self.target = target
        self.cache_dir = cache_dir
        self.kind, self.path = _kind_of(target)
        self.url = re.sub(r"/(v1|sessions)/?$", "", target.rstrip("/"))
        """A live proxy's base URL."""
        self._steps: dict[str, Step] = {}
        self._metrics: dict[int, dict[str, Any]] = {}
        self._metrics_end = 0
        self._fetched = 0.0
        self._store_stamp: tuple[float, ...] = ()
        self._lock = threading.Lock()
        self.config = self._config()

    # -- what the run says about itself ---------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        if self.kind != "run" or not (self.path / "config.json").is_file():
            return {}
        try:
            config = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError):
            return {}
        return config if isinstance(config, dict) else {}

    @property
    def tokenizer(self) -> str | None:
        """The run's model (its tokenizer decodes the tokens), when the run names it."""
        actor = self.config.get("actor")
        model = actor.get("model") if isinstance(actor, dict) else None
        return str(model) if model else None

    @property
    def estimator(self) -> str | None:
        algo = self.config.get("algo")
        return str(algo["estimator"]) if isinstance(algo, dict) and "estimator" in algo else None

    @property
    def env(self) -> str | None:
        env = self.config.get("env") or self.config.get("agent")
        return str(env) if env else None

    # -- steps and metrics ----------------------------------------------------------------------

    def steps(self) -> list[Step]:
        """The steps, in order, each indexed up to its last complete line."""
        with self._lock:
            for path, key in self._files():
                step = self._steps.get(key)
                if step is None:
                    in_run = self.kind == "run" or (
                        self.kind == "file" and path.resolve().parent.name == "rollouts")
                    trained = TrainedIndex(trained_file_of(path.resolve())) if in_run else None
                    step = self._steps[key] = Step(key, FileIndex(path), path.parent / "images",
                                                   trained)
                step.index.refresh()
            return list(self._steps.values())

    def step(self, key: str) -> Step:
        found = self._steps.get(key)
        if found is None:
            self.steps()
            found = self._steps.get(key)
        if found is None:
            raise KeyError(f"no step {key!r}; steps: {', '.join(self._steps) or 'none'}")
        return found

    def _files(self) -> list[tuple[Path, str]]:
        if self.kind == "run":
            found = [(p, m.group(1)) for p in (self.path / "rollouts").glob("step_*.jsonl")
                     if (m := _STEP_FILE.search(p.name))]
            return [(p, str(int(n))) for p, n in sorted(found, key=lambda pn: int(pn[1]))]
        if self.kind == "file":
            return [(self.path, self.path.name)]
        out = self.cache_dir / f"{self.kind}.jsonl"
        try:
            if self.kind == "sessions":
                self._export_store(out)
            else:
                self._fetch_live(out)
        except (OSError, RuntimeError) as e:  # StoreError, a cache folder's failure
            raise ValueError(f"{self.target}: {e}") from None
        return [(out, "sessions")]

    def metrics(self) -> dict[int, dict[str, Any]]:
        """Each step's line of metrics.jsonl (read from where the last look stopped)."""
        path = self.path / "metrics.jsonl" if self.kind == "run" else None
        if path is None or not path.is_file():
            return self._metrics
        with self._lock, path.open("rb") as f:
            f.seek(self._metrics_end)
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # being written
                self._metrics_end += len(raw)
                try:
                    row = json.loads(raw)
                    self._metrics[int(row["step"])] = row
                except (ValueError, KeyError, TypeError):
                    continue  # a torn line of a killed run: the step's rollouts still show
        return self._metrics

    # -- proxies --------------------------------------------------------------------------------

    def _export_store(self, out: Path) -> None:
        from servers.durable import read_sessions

        wal = self.path.with_name(self.path.name + "-wal")
        stamp = tuple(p.stat().st_mtime_ns for p in (self.path, wal) if p.exists())
        if stamp == self._store_stamp and out.exists():
            return
        with replaced_atomically(out) as tmp, tmp.open("w") as f:
            for session in read_sessions(self.path):
                f.writelines(t.to_json() + "\n" for t in session.trajectories())
        self._store_stamp = stamp

    def _fetch_live(self, out: Path) -> None:
        if time.monotonic() - self._fetched < LIVE_REFRESH_S and out.exists():
            return
        import httpx

        from agentrl.http_client import http_client

        try:
            with http_client(timeout_s=60.0) as client, \
                    client.stream("GET", f"{self.url}/export") as response:
                if response.status_code != 200:
                    raise ValueError(f"{self.url}/export answered {response.status_code}; is "
                                     f"this an agentrl serve?")
                with replaced_atomically(out) as tmp, tmp.open("wb") as f:
                    for chunk in response.iter_bytes():
                        f.write(chunk)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot fetch {self.url}/export: {e}") from None
        self._fetched = time.monotonic()


def _kind_of(target: str) -> tuple[str, Path]:
    """("run" | "file" | "sessions" | "live", path), or a one-line ValueError."""
    if re.match(r"https?://", target):
        return "live", Path()
    path = Path(target)
    if not path.exists():
        raise ValueError(f"{target}: no such file or directory; agentrl view takes "
                         f"{WHAT_IS_VIEWED}")
    if path.is_dir():
        if (path / "rollouts").is_dir() or (path / "metrics.jsonl").is_file():
            return "run", path
        raise ValueError(f"{target} is not a run: it holds no rollouts/ and no metrics.jsonl; "
                         f"agentrl view takes {WHAT_IS_VIEWED}")
    with path.open("rb") as f:
        head = f.read(16)
    if head.startswith(b"SQLite format 3"):
        return "sessions", path
    if head.lstrip()[:1] in (b"{", b""):
        return "file", path
    raise ValueError(f"{target} is neither JSON lines nor an SQLite sessions file; agentrl "
                     f"view takes {WHAT_IS_VIEWED}")
