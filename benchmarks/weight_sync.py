"""Weight sync through Ray, as placed mode does it: the time to push a model's weights in
buckets into a rollout worker (and, with `--engines 2`, its second engine too), per bucket size.

    python benchmarks/weight_sync.py [--model smollm2-135m-instruct] [--engines 1]

The driver holds the weights (fp32) and sends each bucket with `RolloutWorker.update_weights`,
which loads them into its engines at the last bucket (as `Trainer._sync_weights` does). One
warm-up sync, then the median of 3 per bucket size. Prints the CPU with its vector flags.
"""

from __future__ import annotations

import argparse
import statistics
import time

from machine import cpu_description  # benchmarks/machine.py


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--buckets_mb", type=int, nargs="+", default=[16, 64, 256, 1024])
    args = ap.parse_args()

    import ray

    from agentrl.models import load_model
    from trainers.cli import build_config
    from trainers.ray_utils import init_ray, shutdown_ray
    from trainers.rollout_engines import EngineWorker
    from trainers.rollout_worker import RolloutWorker, weight_buckets

    cfg = build_config(["--env", "digits", "--actor.model", args.model, "--actor.lr", "1e-5",
                        "--rollout.mode",
                        "placed", "--rollout.num_engines", str(args.engines)])
    init_ray()
    try:
        extra = [ray.remote(EngineWorker).options(num_cpus=0).remote(cfg)
                 for _ in range(args.engines - 1)]
        worker = ray.remote(RolloutWorker).options(num_cpus=0).remote(cfg, None, extra)
        weights = {k: v.detach().clone() for k, v in load_model(args.model).state_dict().items()}
        total = sum(t.numel() * t.element_size() for t in weights.values())
        version = 0
        print(f"CPU: {cpu_description()}; {args.model}: {total / 2**20:.0f} MiB of fp32 weights "
              f"into {args.engines} engine(s) through Ray")
        print("| bucket MiB | buckets | sync s (median of 3) | GiB/s |")
        print("|---|---|---|---|")
        for mb in args.buckets_mb:
            buckets = list(weight_buckets(weights, mb))
            times = []
            for _ in range(4):
                version += 1
                t0 = time.perf_counter()
                for i, b in enumerate(buckets):
                    ray.get(worker.update_weights.remote(b, version, i == len(buckets) - 1))
                times.append(time.perf_counter() - t0)
            t = statistics.median(times[1:])
            print(f"| {mb} | {len(buckets)} | {t:.2f} | {total / 2**30 / t:.2f} |")
        assert ray.get(worker.version.remote()) == version
    finally:
        shutdown_ray()


if __name__ == "__main__":
    main()
