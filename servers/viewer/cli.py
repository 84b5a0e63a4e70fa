"""`agentrl view RUN_DIR`: browse a run's trajectories in a local web page (offline: the page is
served from the package, no CDN, no build step).

    agentrl view runs/math-tir                        # a run directory
    agentrl view rollouts.jsonl --tokenizer embedded  # a trajectories file
    agentrl view ~/.local/share/agentrl/sessions/m.sqlite --tokenizer embedded
    agentrl view http://127.0.0.1:8000                # a live agentrl serve

Steps, then episodes, then turns: the sampled tokens coloured by log-prob, advantage, policy
version or trainer-vs-sampler mismatch (a run's trained/ files: the trainer's log-probs before
each update and the advantages it used); tool calls and tool outputs as text; screenshots;
rewards and their parts; drift, segments, discarded episodes and why; filters; a prompt's
samples side by side; a step's metrics beside its episodes.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from agentrl.command_line import parse_flags
from servers.viewer.app import Viewer, serve
from servers.viewer.render import Decoder
from servers.viewer.source import Source


@dataclass(frozen=True, kw_only=True)
class ViewArgs:
    target: tyro.conf.Positional[str]
    """A run directory, a trajectories .jsonl file, a proxy's sessions .sqlite file, or a
    proxy's URL."""
    tokenizer: str = ""
    """The tokenizer that decodes the tokens (a model name or path); empty: the run's model
    (config.json's actor.model), or token ids where none is known."""
    host: str = "127.0.0.1"
    """Where the page is served (the loopback by default: the page shows the run to anyone
    who can reach it)."""
    port: int = 8765
    """The page's port (0: any free port)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0..65535, got {self.port}")


def open_viewer(args: ViewArgs, cache_dir: Path) -> Viewer:
    """The viewer of `args.target`, its files indexed; a one-line ValueError for a target that
    is not something to view."""
    source = Source(args.target, cache_dir=cache_dir)
    source.steps()  # the one streaming pass over every file
    return Viewer(source, Decoder(args.tokenizer or source.tokenizer))


def main(argv: list[str]) -> int:
    args = parse_flags(ViewArgs, argv, prog="agentrl view", doc=__doc__)
    with tempfile.TemporaryDirectory(prefix="agentrl-view-") as cache:
        t0 = time.perf_counter()
        try:
            viewer = open_viewer(args, Path(cache))
            server = serve(viewer, args.host, args.port)
        except (ValueError, OSError) as e:
            print(f"agentrl view: {e}", file=sys.stderr)
            return 2
        steps = viewer.source.steps()
        episodes = sum(len(s.index) for s in steps)
        host, port = server.server_address[:2]
        print(f"agentrl view: {len(steps)} step(s), {episodes} record(s) indexed in "
              f"{time.perf_counter() - t0:.2f} s; open http://{host!s}:{port}/", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
        server.server_close()
    return 0
