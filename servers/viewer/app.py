"""The viewer's HTTP server (stdlib): the static page and the JSON it pages through.

    GET /                      the page (static/index.html, viewer.js, viewer.css; no CDN)
    GET /api/run               the steps, each with its counts and its line of metrics
    GET /api/episodes          a page of episode summaries: step (or all), offset, limit and
                               the filters rmin, rmax, discarded, drift, corrupt (any | only |
                               none), task (a substring of the env/task)
    GET /api/episode           one record's page: step, line
    GET /api/turn              one turn's tokens: step, line, turn
    GET /api/group             a prompt's samples side by side: step, group
    GET /api/image             an image of a record as PNG: step, line, index

A page never holds more than one record's tokens: records are read from their files by offset.
The Content-Security-Policy runs no script but the page's own, so text that slipped into the
page as markup still could not run.
"""

from __future__ import annotations

import io
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from agentrl.terminal_safe import visible
from servers.viewer import render
from servers.viewer.index import Summary
from servers.viewer.source import Source, Step

log = logging.getLogger(__name__)

MAX_PAGE = 500
_STATIC = {"index.html": "text/html", "viewer.js": "text/javascript", "viewer.css": "text/css"}
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'")
_SHA = re.compile(r"[0-9a-f]{64}")


class Viewer:
    """The answers of the JSON routes, over one `Source` and one `Decoder`."""

    def __init__(self, source: Source, decoder: render.Decoder) -> None:
        self.source = source
        self.decoder = decoder
        self._advantages: dict[str, tuple[int, dict[int, float]]] = {}
        self._lock = threading.Lock()

    def run(self) -> dict[str, Any]:
        steps = self.source.steps()
        metrics = self.source.metrics()
        keys = sorted({k for row in metrics.values() for k in row if k != "step"})
        rows = []
        seen = set()
        for step in steps:
            s = step.index.summaries
            kept = [x["reward"] for x in s if not x["discard"] and not x["corrupt"]]
            n = step.key
            seen.add(n)
            rows.append({
                "key": n, "episodes": len(s), "corrupt": sum(bool(x["corrupt"]) for x in s),
                "discarded": sum(x["discard"] for x in s), "drift": sum(x["drift"] for x in s),
                "mean_reward": sum(kept) / len(kept) if kept else None,
                "metrics": metrics.get(int(n)) if n.isdigit() else None,
                "trained": step.trained is not None and step.trained.path.is_file(),
            })
        # Steps with metrics but no rollouts (save_rollouts off): their metrics still show.
        rows += [{"key": str(k), "episodes": 0, "corrupt": 0, "discarded": 0, "drift": 0,
                  "mean_reward": None, "metrics": m, "trained": False}
                 for k, m in sorted(metrics.items()) if str(k) not in seen]
        rows.sort(key=lambda r: int(r["key"]) if r["key"].isdigit() else -1)
        return {"target": visible(self.source.target), "kind": self.source.kind,
                "tokenizer": self.decoder.name, "tokenizer_error": self.decoder.error,
                "estimator": self.source.estimator, "env": self.source.env,
                "metric_keys": keys, "steps": rows}

    def advantages(self, step: Step) -> dict[int, float]:
        """Each episode's advantage by line: the trainer's (the mean over its trained tokens)
        where the step has a trained/ file, else recomputed (`render.group_advantages`)."""
        if step.trained is not None and step.trained.refresh():
            return step.trained.advantages
        n = len(step.index)
        with self._lock:
            cached = self._advantages.get(step.key)
            if cached is None or cached[0] != n:
                cached = (n, render.group_advantages(self.source.estimator,
                                                     step.index.summaries[:n]))
                self._advantages[step.key] = cached
        return cached[1]

    def advantage_source(self, step: Step) -> str | None:
        """"trainer", or the estimator whose advantage the viewer recomputes, or None."""
        if step.trained is not None and step.trained.refresh():
            return "trainer"
        estimator = self.source.estimator
        return estimator if estimator in render.GROUP_ESTIMATORS else None

    def episodes(self, q: dict[str, str]) -> dict[str, Any]:
        offset = _int(q, "offset", 0)
        limit = _int(q, "limit", 50)
        if not 1 <= limit <= MAX_PAGE or offset < 0:
            raise ValueError(f"limit must be 1..{MAX_PAGE} and offset >= 0, got {limit}, {offset}")
        keep = _filter(q)
        steps = self.source.steps()
        if q.get("step", "all") != "all":
            steps = [self.source.step(q["step"])]
        total, rows = 0, []
        for step in steps:
            advantages = None
            for s in step.index.summaries:
                if not keep(s):
                    continue
                if offset <= total < offset + limit:
                    if advantages is None:
                        advantages = self.advantages(step)
                    rows.append({**render.visible_fields(s), "step": step.key,
                                 "advantage": advantages.get(s["line"])})
                total += 1
        return {"total": total, "offset": offset, "rows": rows}

    def _record(self, q: dict[str, str]) -> tuple[Step, Summary, dict[str, Any]]:
        step = self.source.step(q.get("step", ""))
        i = step.index.position(_int(q, "line", 0))
        return step, step.index.summaries[i], step.index.read(i)

    def episode(self, q: dict[str, str]) -> dict[str, Any]:
        step, summary, record = self._record(q)
        summaries = step.index.summaries
        siblings = [s for s in summaries if s["episode"] == summary["episode"]]
        group = ([s for s in summaries if s["group"] == summary["group"]]
                 if summary["group"] is not None else [])
        view = render.episode_view(record, summary, self.advantages(step).get(summary["line"]),
                                   siblings, group)
        return {**view, "step": step.key, "advantage_source": self.advantage_source(step)}

    def turn(self, q: dict[str, str]) -> dict[str, Any]:
        step, summary, record = self._record(q)
        trained, why = (step.trained.lookup(summary["line"], record) if step.trained is not None
                        else (None, "not a run's rollouts: no trainer's log-probs"))
        return render.turn_view(record, _int(q, "turn", 0), self.decoder,
                                self.advantages(step).get(summary["line"]), trained=trained,
                                trained_note=why)

    def group(self, q: dict[str, str]) -> dict[str, Any]:
        step = self.source.step(q.get("step", ""))
        name = q.get("group", "")
        advantages = self.advantages(step)
        members = []
        for i, s in enumerate(step.index.summaries):
            if s["group"] == name and not s["corrupt"]:
                members.append(render.group_member(step.index.read(i), s,
                                                   advantages.get(s["line"]), self.decoder))
        if not members:
            raise KeyError(f"step {step.key} has no group {name!r}")
        return {"step": step.key, "group": visible(name), "estimator": self.source.estimator,
                "advantage_source": self.advantage_source(step), "members": members}

    def image(self, q: dict[str, str]) -> bytes:
        step, _, record = self._record(q)
        images = record.get("images") or []
        k = _int(q, "index", 0)
        if not 0 <= k < len(images):
            raise IndexError(f"the record has {len(images)} images, not {k + 1}")
        im = images[k]
        sha = str(im.get("sha256", ""))
        if _SHA.fullmatch(sha):
            return (step.images / f"{sha}.png").read_bytes()
        from PIL import Image as PILImage

        from agentrl.types import Image

        pixels = Image.from_dict(im).pixels
        out = io.BytesIO()
        PILImage.fromarray(pixels, "RGB").save(out, format="PNG")
        return out.getvalue()


def _int(q: dict[str, str], key: str, default: int) -> int:
    try:
        return int(q.get(key, default))
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {q[key]!r}") from None


def _float(q: dict[str, str], key: str) -> float | None:
    if q.get(key, "") == "":
        return None
    try:
        return float(q[key])
    except ValueError:
        raise ValueError(f"{key} must be a number, got {q[key]!r}") from None


def _filter(q: dict[str, str]) -> Callable[[Summary], bool]:
    """The episode list's filters as one predicate."""
    rmin, rmax = _float(q, "rmin"), _float(q, "rmax")
    modes = {}
    for key in ("discarded", "drift", "corrupt"):
        mode = q.get(key, "any") or "any"
        if mode not in ("any", "only", "none"):
            raise ValueError(f"{key} must be any, only or none, got {mode!r}")
        modes[key] = mode
    field = {"discarded": "discard", "drift": "drift", "corrupt": "corrupt"}
    task = q.get("task", "").lower()

    def keep(s: Summary) -> bool:
        for key, mode in modes.items():
            if mode != "any" and bool(s[field[key]]) != (mode == "only"):
                return False
        if rmin is not None and s["reward"] < rmin:
            return False
        if rmax is not None and s["reward"] > rmax:
            return False
        return not task or task in s["task"].lower()

    return keep


def make_handler(viewer: Viewer) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[dict[str, str]], Any]] = {
        "/api/run": lambda q: viewer.run(), "/api/episodes": viewer.episodes,
        "/api/episode": viewer.episode, "/api/turn": viewer.turn, "/api/group": viewer.group,
    }

    class Handler(BaseHTTPRequestHandler):
        server_version = "agentrl-view"

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            q = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                if url.path in ("/", "/index.html"):
                    self._static("index.html")
                elif url.path.startswith("/static/"):
                    self._static(url.path.removeprefix("/static/"))
                elif url.path == "/api/image":
                    self._send(HTTPStatus.OK, "image/png", viewer.image(q))
                elif url.path in routes:
                    self._json(HTTPStatus.OK, routes[url.path](q))
                else:
                    self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {url.path}"})
            except (KeyError, IndexError, FileNotFoundError) as e:
                self._json(HTTPStatus.NOT_FOUND, {"error": visible(_message(e))})
            except ValueError as e:
                self._json(HTTPStatus.BAD_REQUEST, {"error": visible(_message(e))})
            except (BrokenPipeError, ConnectionResetError):
                pass  # the page went away
            except Exception as e:
                log.exception("viewer: %s failed", self.path)
                self._json(HTTPStatus.INTERNAL_SERVER_ERROR,
                           {"error": visible(f"{type(e).__name__}: {e}")})

        def _static(self, name: str) -> None:
            if name not in _STATIC:
                raise KeyError(f"no static file {name!r}")
            body = resources.files("servers.viewer").joinpath("static", name).read_bytes()
            self._send(HTTPStatus.OK, f"{_STATIC[name]}; charset=utf-8", body)

        def _json(self, status: HTTPStatus, payload: Any) -> None:
            body = json.dumps(payload, ensure_ascii=False, allow_nan=False).encode()
            self._send(status, "application/json; charset=utf-8", body)

        def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Security-Policy", _CSP)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("viewer: " + format, *args)

    return Handler


def _message(e: BaseException) -> str:
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def serve(viewer: Viewer, host: str, port: int) -> ThreadingHTTPServer:
    """The server, bound and not yet serving (`serve_forever`, or `serving` for tests)."""
    server = ThreadingHTTPServer((host, port), make_handler(viewer))
    server.daemon_threads = True
    return server


def serving(server: ThreadingHTTPServer) -> Iterator[str]:
    """Serve in a thread while the generator is suspended; yields the base URL."""
    thread = threading.Thread(target=server.serve_forever, name="viewer", daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host!s}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
