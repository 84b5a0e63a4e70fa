"""Proxy overhead: latency the recording proxy adds on top of the engine, under load.

    python benchmarks/proxy_overhead.py                  # fake engine, 64 sessions + 256 streams,
                                                         # /v1/chat/completions and /v1/messages
    python benchmarks/proxy_overhead.py --real           # also the transformers engine (embedded)
    python benchmarks/proxy_overhead.py --hostile        # 64 sessions beside one client that
                                                         # sends 5 MB and 30 MB messages

The proxy runs in its own process (uvicorn on 127.0.0.1, as deployed); the load generator is a
minimal keep-alive HTTP/1.1 client on asyncio streams in this process, so client overhead stays
small. With a fake engine of fixed latency L, the engine alone answers in L; whatever the client
sees beyond that is the proxy (HTTP, validation, chat template, tokenization, recording).
Every run stops by itself (a fixed number of requests per session).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _serve(port: int, engine_kind: str, latency: float, token_latency: float,
           tokenizer: str = "tiny") -> None:
    import uvicorn

    from agentrl.engine.fakes import StreamingFakeEngine
    from agentrl.models import load_tokenizer
    from servers.app import create_app
    from servers.config import ProxyConfig

    if engine_kind == "real":
        from agentrl.engine import create_engine  # type: ignore[attr-defined]

        tok = load_tokenizer("embedded")
        engine = create_engine("embedded", tokenizer=tok)
    else:
        tok = load_tokenizer(tokenizer)
        engine = StreamingFakeEngine(
            tok,
            latency_s=latency,
            token_latency_s=token_latency,
            reply=lambda p, _i: "reply " + p.split("session ")[-1].split("<")[0],
        )
    app = create_app(engine, tok, config=ProxyConfig(model_name="m"))
    from servers.serving import freeze_startup_objects, http_protocol

    if os.environ.get("AGENTRL_BENCH_NO_FREEZE") is None:  # as `agentrl serve` does
        freeze_startup_objects()
    # The HTTP protocol `agentrl serve` runs (a bound on request heads).
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                http=http_protocol())


class Conn:
    """One keep-alive HTTP/1.1 connection (one per session, like an agent's client)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        data = json.dumps(body).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        assert self.reader is not None
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {
            k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
        }
        if "content-length" in headers:
            return status, await self.reader.readexactly(int(headers["content-length"]))
        chunks = []
        while True:  # chunked transfer (SSE)
            size = int((await self.reader.readline()).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                return status, b"".join(chunks)
            chunks.append(chunk[:-2])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _direct(latency: float, n: int, sessions: int) -> list[float]:
    """The engine called directly, same concurrency: the baseline the proxy is compared to."""
    from agentrl.completion import SamplingParams
    from agentrl.engine.fakes import StreamingFakeEngine
    from agentrl.models import load_tokenizer

    tok = load_tokenizer("tiny")
    engine = StreamingFakeEngine(tok, latency_s=latency)
    ids = tok.encode("hello", add_special_tokens=False)
    out: list[float] = []

    async def one(i: int) -> None:
        await asyncio.sleep(latency * i / sessions)  # same staggering as the proxy load
        for _ in range(n):
            t = time.perf_counter()
            await engine.generate(ids, SamplingParams(max_tokens=32))
            out.append(time.perf_counter() - t)

    await asyncio.gather(*(one(i) for i in range(sessions)))
    return out


def _text(route: str, stream: bool, data: bytes) -> str:
    """The answer's text from a chat completion or an Anthropic message, streamed or not."""
    if not stream:
        body = json.loads(data)
        if route == "messages":
            return "".join(b.get("text", "") for b in body["content"])
        return body["choices"][0]["message"]["content"]
    events = [json.loads(line[6:]) for b in data.split(b"\n\n") for line in b.split(b"\n")
              if line.startswith(b"data: {")]
    if route == "messages":
        return "".join(e["delta"].get("text", "") for e in events
                       if e["type"] == "content_block_delta")
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events)


ROUTES = {"chat": "/v1/chat/completions", "messages": "/v1/messages"}


async def _load(
    port: int, sessions: int, n: int, stream: bool, tag: str, stagger: float = 0.0,
    route: str = "chat",
) -> dict:
    lat: list[float] = []
    mixed = 0
    errors = 0

    async def session(i: int) -> None:
        nonlocal mixed, errors
        conn = Conn(port)
        body = {
            "model": "m",
            "stream": stream,
            "max_tokens": 32,
            "messages": [{"role": "user", "content": f"session {tag}{i}"}],
        }
        # Agents do not fire in lockstep: spread session starts over one engine latency, so
        # the steady state has requests arriving independently (stagger=0 is a burst test).
        await asyncio.sleep(stagger * i / sessions)
        try:
            for _ in range(n):
                t = time.perf_counter()
                status, data = await conn.post(f"/sessions/{tag}{i}{ROUTES[route]}", body)
                lat.append(time.perf_counter() - t)
                if status != 200:
                    errors += 1
                    continue
                text = _text(route, stream, data)
                if tag == "fake" and text != f"reply {tag}{i}":
                    mixed += 1
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(sessions)))
    wall = time.perf_counter() - t0
    return {"lat": lat, "mixed": mixed, "errors": errors, "wall": wall, "requests": len(lat)}


def _start(port: int, kind: str, latency: float, token_latency: float,
           tokenizer: str = "tiny") -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            "--port",
            str(port),
            "--engine",
            kind,
            "--latency",
            str(latency),
            "--token-latency",
            str(token_latency),
            "--tokenizer",
            tokenizer,
        ],
        cwd=ROOT,
    )
    import urllib.request

    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("proxy did not start")


def _row(name: str, r: dict, base_p50: float, base_p99: float) -> str:
    p50, p99 = _pct(r["lat"], 0.5), _pct(r["lat"], 0.99)
    return (
        f"| {name} | {r['requests']} | {p50 * 1e3:.2f} | {p99 * 1e3:.2f} | "
        f"{(p50 - base_p50) * 1e3:.2f} | {(p99 - base_p99) * 1e3:.2f} | "
        f"{r['requests'] / r['wall']:.0f} | {r['errors']} | {r['mixed']} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="fake", choices=["fake", "real"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--latency", type=float, default=0.2, help="fake engine latency (s)")
    ap.add_argument("--token-latency", type=float, default=0.0)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--requests", type=int, default=20, help="requests per session")
    ap.add_argument("--real", action="store_true", help="also run the transformers engine")
    ap.add_argument("--real-only", action="store_true", help="only the transformers engine")
    ap.add_argument("--hostile", action="store_true",
                    help="only: 64 sessions beside a client sending huge messages")
    ap.add_argument("--tokenizer", default="tiny", help=argparse.SUPPRESS)
    ap.add_argument("--huge-client", type=float, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.huge_client:
        _huge_client(args.port, args.huge_client, args.rate)
        return
    if args.serve:
        _serve(args.port, args.engine, args.latency, args.token_latency, args.tokenizer)
        return
    if args.hostile:
        _hostile(args)
        return

    if args.real_only:
        _real(args.port + 1)
        return
    direct = asyncio.run(_direct(args.latency, args.requests, args.sessions))
    b50, b99 = _pct(direct, 0.5), _pct(direct, 0.99)
    print(
        f"# proxy overhead ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()})"
    )
    print(
        f"engine alone: p50 {b50 * 1e3:.2f} ms, p99 {b99 * 1e3:.2f} ms "
        f"(fake, fixed latency {args.latency * 1e3:.0f} ms, {args.sessions} concurrent)\n"
    )
    print(
        "| load | requests | p50 ms | p99 ms | added p50 ms | added p99 ms | req/s | errors "
        "| mixed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    proc = _start(args.port, "fake", args.latency, args.token_latency)
    try:
        for route in ROUTES:  # warm up
            asyncio.run(_load(args.port, 4, 5, False, "fake", route=route))
        for stagger, label in ((args.latency, "staggered"), (0.0, "lockstep burst")):
            for stream in (False, True):
                for route, path in ROUTES.items():  # the same load through both, in turn
                    r = asyncio.run(_load(args.port, args.sessions, args.requests, stream,
                                          "fake", stagger, route))
                    kind = "stream" if stream else "non-stream"
                    name = f"{args.sessions} sessions, {kind}, {label}, {path}"
                    print(_row(name, r, b50, b99), flush=True)
        r = asyncio.run(_load(args.port, 256, 4, True, "fake", args.latency))
        print(_row("256 sessions, stream, staggered", r, b50, b99), flush=True)
    finally:
        proc.terminate()
        proc.wait()
    if args.real:
        _real(args.port + 1)
    print(f"\nmedian of direct calls {statistics.median(direct) * 1e3:.2f} ms")


def _huge_client(port: int, mb: float, rate: float) -> None:
    """Another process (as a real client would be): send one user message of `mb` MB (about
    0.2 M tokens per MB) `rate` times a second (0: back to back, a flood) until SIGTERM, then
    print status counts and times."""
    import http.client
    import signal

    body = json.dumps({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "lorem ipsum " * int(mb * 2**20 // 12)}]}).encode()
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    out: dict[int, list[float]] = {}
    conn = http.client.HTTPConnection("127.0.0.1", port)
    start = time.perf_counter()
    sent = 0
    while not stop:
        if rate:
            time.sleep(max(0.0, start + sent / rate - time.perf_counter()))
        sent += 1
        t = time.perf_counter()
        try:
            conn.request("POST", "/v1/chat/completions", body,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            status = resp.status
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port)
            status = 0
        out.setdefault(status, []).append(time.perf_counter() - t)
    print(json.dumps({str(k): v for k, v in out.items()}), flush=True)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def _hostile(args: argparse.Namespace) -> None:
    """#17 item 2: what one client sending huge messages costs everyone else."""
    direct = asyncio.run(_direct(args.latency, args.requests, args.sessions))
    b50, b99 = _pct(direct, 0.5), _pct(direct, 0.99)
    print(f"# proxy beside a hostile client ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, embedded tokenizer, "
          f"fake engine {args.latency * 1e3:.0f} ms)\n")
    print("| load | requests | p50 ms | p99 ms | added p50 ms | added p99 ms | req/s | errors "
          "| mixed | huge requests (status: count, median s) | server RSS MB before/after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    proc = _start(args.port, "fake", args.latency, 0.0, tokenizer="embedded")
    try:
        asyncio.run(_load(args.port, 4, 5, False, "fake"))  # warm up
        for mb, rate in ((0, 0), (5, 10), (30, 2), (5, 0), (30, 0), (0.1, 0)):
            before = _rss_mb(proc.pid)

            client = None
            if mb:
                client = subprocess.Popen(
                    [sys.executable, __file__, "--huge-client", str(mb), "--rate", str(rate),
                     "--port", str(args.port)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
                time.sleep(1.0)
            r = asyncio.run(_load(args.port, args.sessions, args.requests, False, "fake",
                                  args.latency))
            outcome: dict[str, list[float]] = {}
            if client is not None:
                client.terminate()
                outcome = json.loads(client.communicate()[0] or "{}")
            said = ", ".join(f"{st}: {len(v)}, {statistics.median(v):.2f}"
                             for st, v in sorted(outcome.items())) or "-"
            pace = f"{rate:g}/s" if rate else "back to back"
            name = f"{args.sessions} sessions" + (f" + {mb:g} MB messages {pace}" if mb else
                                                  ", quiet")
            print(f"{_row(name, r, b50, b99)} {said} | {before:.0f} / "
                  f"{_rss_mb(proc.pid):.0f} |", flush=True)
    finally:
        proc.terminate()
        proc.wait()


def _real(port: int) -> None:
    """The same load through the transformers engine with the embedded model (max_tokens 32)."""
    print("\n| real engine load | requests | p50 ms | p99 ms | req/s | errors |")
    print("|---|---|---|---|---|---|")
    proc = _start(port, "real", 0, 0)
    try:
        for sessions, stream in ((64, False), (64, True), (256, True)):
            r = asyncio.run(_load(port, sessions, 2, stream, "real"))
            lat = r["lat"]
            kind = "stream" if stream else "non-stream"
            print(
                f"| {sessions} sessions, {kind} | {r['requests']} | {_pct(lat, 0.5) * 1e3:.0f} "
                f"| {_pct(lat, 0.99) * 1e3:.0f} | {r['requests'] / r['wall']:.1f} "
                f"| {r['errors']} |",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
