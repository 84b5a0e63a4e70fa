"""The engine router (agentrl/engine/router.py): throughput over N engines and its added latency.

    python benchmarks/router.py                      # fake engines (no model)
    python benchmarks/router.py --real 2             # + 2 real transformers engines vs 1

Fake engines have a fixed per-token latency and a number of slots (continuous batching: up to
`slots` requests decode at once, each at `per_token_ms` a token; more wait). Multi-turn
episodes (3 turns, each a call of 8-32 tokens, every turn of an episode in one conversation so
it sticks to one engine) are run by enough concurrent clients to keep every slot busy; the
throughput with N engines is compared with one engine's, measured in the same run (ideal: N x).
The router's added latency is the p50 of a routed call minus a direct call, with an engine that
answers at once. `--real K` also runs real transformers engines (the tiny model on this CPU)
behind the router, K against 1: on a 2-core machine they share the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from machine import cpu_description  # benchmarks/machine.py

from agentrl.completion import Completion, SamplingParams
from agentrl.engine.affinity import conversation
from agentrl.engine.router import EngineRouter


class FixedLatencyEngine:
    """`slots` requests at a time, each taking max_tokens x per_token_s."""

    def __init__(self, per_token_s: float, slots: int) -> None:
        self.per_token_s = per_token_s
        self._slots = asyncio.Semaphore(slots)
        self.version, self.max_context = 0, 4096

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       images: object = None) -> list[Completion]:
        async with self._slots:
            if self.per_token_s:
                await asyncio.sleep(params.max_tokens * self.per_token_s)
        return [Completion(token_ids=[1] * params.max_tokens, logprobs=[0.0] * params.max_tokens,
                           finish_reason="length")]


async def _episodes(engine: object, clients: int, episodes: int, seed: int = 0) -> float:
    """Tokens per second over `episodes` 3-turn episodes run by `clients` workers."""
    rng = random.Random(seed)
    plan = [[rng.randint(8, 32) for _ in range(3)] for _ in range(episodes)]
    queue: asyncio.Queue[tuple[int, list[int]]] = asyncio.Queue()
    for i, turns in enumerate(plan):
        queue.put_nowait((i, turns))
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        while not queue.empty():
            i, turns = queue.get_nowait()
            context = [0] * 32
            with conversation(f"ep{i}"):
                for n in turns:
                    [c] = await engine.generate(context, SamplingParams(max_tokens=n))  # type: ignore[attr-defined]
                    context += c.token_ids
                    tokens += len(c.token_ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return tokens / (time.perf_counter() - t0)


async def _overhead(calls: int) -> tuple[float, float]:
    """p50 latency (s) of a direct call and of a routed one, to an engine that answers at once."""
    engine = FixedLatencyEngine(0.0, 1 << 30)
    router = EngineRouter([FixedLatencyEngine(0.0, 1 << 30) for _ in range(8)])
    params = SamplingParams(max_tokens=16)
    prompt = list(range(256))
    direct, routed = [], []
    for i in range(calls):
        t0 = time.perf_counter()
        await engine.generate(prompt, params)
        t1 = time.perf_counter()
        with conversation(f"s{i % 1000}"):
            await router.generate(prompt, params)
        t2 = time.perf_counter()
        direct.append(t1 - t0)
        routed.append(t2 - t1)
    return statistics.median(direct), statistics.median(routed)


async def _real(k: int) -> tuple[float, float]:
    from agentrl.engine import create_engine
    from agentrl.models import load_tokenizer

    tok = load_tokenizer("tiny")
    results = []
    for n in (1, k):
        engines = [create_engine("tiny", tokenizer=tok) for _ in range(n)]
        router = EngineRouter(engines)
        try:
            await _episodes(router, 8 * n, 4 * n, seed=1)  # warm-up
            results.append(await _episodes(router, 8 * n, 32 * n))
        finally:
            router.close()
    return results[0], results[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per_token_ms", type=float, default=2.0)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--real", type=int, default=0)
    args = ap.parse_args()
    per_token = args.per_token_ms / 1000
    rows = []
    for n in args.engines:
        router = EngineRouter([FixedLatencyEngine(per_token, args.slots) for _ in range(n)])
        tps = asyncio.run(_episodes(router, clients=2 * args.slots * n, episodes=64 * n))
        rows.append((n, tps, router.routed))
    base = rows[0][1] / rows[0][0]
    print(f"CPU: {cpu_description()}")
    print(f"fake engines: {args.per_token_ms} ms/token, {args.slots} slots each; 3-turn episodes "
          f"of 8-32 tokens a turn, 2 x slots concurrent clients per engine")
    print("| engines | tokens/s | x one engine | / N (goal >= 0.9) | calls per engine (min-max) |")
    print("|---|---|---|---|---|")
    for n, tps, routed in rows:
        print(f"| {n} | {tps:.0f} | {tps / base:.2f} | {tps / base / n:.2f} | "
              f"{min(routed)}-{max(routed)} |")
    direct, routed = asyncio.run(_overhead(20000))
    print(f"router added latency, p50 over 20000 calls: {(routed - direct) * 1e6:.1f} us "
          f"(direct call {direct * 1e6:.1f} us, routed {routed * 1e6:.1f} us; 8 engines, "
          f"1000 conversations)")
    if args.real:
        one, many = asyncio.run(_real(args.real))
        print(f"real transformers engines (tiny model, this CPU): 1 engine {one:.0f} tokens/s, "
              f"{args.real} engines {many:.0f} tokens/s ({many / one:.2f}x)")


if __name__ == "__main__":
    main()
