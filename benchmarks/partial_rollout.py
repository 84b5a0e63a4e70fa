"""Partial rollout with vLLM: what a weight update costs while a batch is being sampled.

    python benchmarks/partial_rollout.py [--model smollm2-135m-instruct] [--requests 16]
        [--max_tokens 256] [--at 32]

`--requests` samples of `--max_tokens` tokens each (EOS suppressed, so every one runs to the
end) are running when, after `--at` tokens of the first, the trainer's update arrives (the
same weights as a new version: the load itself is what a real update costs). Two ways, on one
engine, in this order:

- baseline, `pause_mode="wait"` (agentrl before partial rollout): running requests finish on
  the old weights first, so `update_weights` returns only when the longest has ended;
- partial rollout, `pause_mode="keep"` (the default): requests stop between two steps, the
  weights load, and they go on with the new ones (their prefixes prefilled again).

Prints, for each: how long `update_weights` blocked its caller (in async training, the time
until the next batch samples with the new weights), the wall time of the whole batch, and
the share of its tokens the new version sampled; then the ratios. Prints the CPU with its
vector flags.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from machine import cpu_description  # benchmarks/machine.py


async def one_run(engine, prompt, params, weights, args, mode: str, version: int) -> dict:
    engine.pause_mode = mode
    processor = engine.llm.output_processor
    tasks = [asyncio.create_task(engine.generate(prompt, params)) for _ in range(args.requests)]
    start = time.perf_counter()
    while True:  # until the first request has sampled --at tokens
        counts = [s.detokenizer.num_output_tokens()
                  for s in list(processor.request_states.values())]
        if counts and max(counts) >= args.at:
            break
        await asyncio.sleep(0.002)
    t0 = time.perf_counter()
    await asyncio.to_thread(engine.update_weights, weights, version)
    blocked = time.perf_counter() - t0
    done = [c for t in tasks for c in await t]
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in done)
    new = sum(v == version for c in done for v in c.token_versions())
    assert tokens == args.requests * args.max_tokens, tokens
    return {"mode": mode, "blocked_s": blocked, "wall_s": wall, "new_share": new / tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max_tokens", type=int, default=256)
    ap.add_argument("--at", type=int, default=32)
    args = ap.parse_args()

    from agentrl.completion import SamplingParams
    from agentrl.engine import open_engine
    from agentrl.models import load_model, load_tokenizer

    tok = load_tokenizer(args.model)
    engine = open_engine(args.model, engine="vllm", device="cpu", tokenizer=tok,
                         max_batch_size=max(args.requests, 1))
    text = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story."}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=0,
                            logit_bias=((tok.eos_token_id, -100.0),))
    weights = load_model(args.model).state_dict()
    print(f"CPU: {cpu_description()}")
    print(f"vLLM engine, {args.model}: {args.requests} requests x {args.max_tokens} tokens; "
          f"the update arrives after {args.at} tokens of the first")
    try:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(engine.generate(prompt, SamplingParams(max_tokens=8)))  # warm-up
        runs = [loop.run_until_complete(one_run(engine, prompt, params, weights, args, mode, v))
                for v, mode in enumerate(("wait", "keep"), start=1)]
    finally:
        engine.close()
    print("| update | update blocks its caller s | batch wall s | tokens by the new version |")
    print("|---|---|---|---|")
    for r in runs:
        name = "wait (baseline)" if r["mode"] == "wait" else "keep (partial rollout)"
        print(f"| {name} | {r['blocked_s']:.2f} | {r['wall_s']:.1f} | {r['new_share']:.0%} |")
    base, partial = runs
    print(f"partial rollout vs baseline: the update blocks "
          f"{base['blocked_s'] / partial['blocked_s']:.1f}x shorter; batch wall "
          f"{partial['wall_s'] / base['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
