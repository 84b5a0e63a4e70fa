"""Multi-turn rollouts: time per 4-turn episode with prefix reuse vs re-prefilling every turn.

Turn k+1's prompt extends turn k's prompt + completion. With the prefix cache the engine resumes
from the cached KV and encodes only the new observation; without it (prefix_cache_bytes=0) it
re-encodes the whole conversation every turn. Same env (agentrl/Digits-v0 with 4 turns), seeds
and sampling settings on both sides; each side runs in its own subprocess.

    python benchmarks/multiturn.py                      # CPU, embedded model
    python benchmarks/multiturn.py --device cuda --episodes 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(args) -> None:
    import gymnasium as gym
    import torch

    import agentrl  # noqa: F401 - registers env ids
    from agentrl.backends import engine_options
    from agentrl.completion import SamplingParams
    from agentrl.engine.transformers_engine import TransformersEngine
    from agentrl.models import load_model, load_tokenizer
    from agentrl.rollout import collect_sync

    torch.manual_seed(0)
    tok = load_tokenizer(args.model)
    engine = TransformersEngine(
        load_model(args.model), tok, device=args.device, seed=0,
        prefix_cache_bytes=(1 << 30) if args.child == "reuse" else 0,
        **engine_options(args.device or "cpu"),
    )
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)

    def env_fn():
        return gym.make("agentrl/Digits-v0", tokenizer=tok, turns=args.turns)

    collect_sync(engine, env_fn, num_prompts=2, sampling=sampling)  # warm-up
    engine.counters.clear()
    t0 = time.perf_counter()
    trajs = collect_sync(engine, env_fn, num_prompts=args.episodes, sampling=sampling)
    dt = time.perf_counter() - t0
    engine.close()
    out = {
        "seconds": dt,
        "episodes": len(trajs),
        "turns": sum(len(t.turns) for t in trajs),
        "sampled_tokens": sum(t.num_policy_tokens for t in trajs),
        "episode_tokens": sum(len(t.token_ids) for t in trajs),
        "counters": dict(engine.counters),
    }
    print("RESULT " + json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48, help="per turn")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--child", choices=["reuse", "reprefill"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    res = {}
    for side in ("reprefill", "reuse"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", side]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{side} failed:\n{proc.stderr[-3000:]}")
        r = res[side] = json.loads(line[7:])
        c = r["counters"]
        print(
            f"{side:>9}: {r['seconds'] / r['episodes']:.2f} s/episode ({r['episodes']} episodes, "
            f"{r['turns']} turns, {r['sampled_tokens']} sampled tokens, {r['episode_tokens']} "
            f"episode tokens; prefilled {c.get('prefill_tokens', 0)}, reused "
            f"{c.get('reused_tokens', 0)})",
            flush=True,
        )
    per = {k: v["seconds"] / v["episodes"] for k, v in res.items()}
    print(f"ratio re-prefill / reuse time per episode: {per['reprefill'] / per['reuse']:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
