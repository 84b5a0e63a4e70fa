"""Step-level credit on a multi-turn env with per-step rewards (#37 item 3): the same loop,
seeds and model trained with three advantages, measured in one run.

- outcome: GRPO's outcome advantage on every turn (`group_norm`, agentrl's default since the
  turn-level outcome advantage replaced reward-to-go);
- rtg_turn: reward-to-go with a per-turn baseline, A_t = (G_t - mean_g G_t) / (std_g G_t + 1e-9)
  over the group's turns with the same index t (G_t = sum_k r_{t+k}, undiscounted; the
  `rtg_turn` estimator, `agentrl.algorithms.gigpo.turn_advantages`);
- gigpo: GRPO's episode advantage plus GiGPO's step advantage among the group's steps taken
  from the same anchor state (`agentrl.algorithms.gigpo`, step_gamma 0.95, weight 1; states
  named by the env, `agentrl.anchors`).

The env is GuessNumber with `progress_reward` (each guess earns the share of [1, high] it rules
out; finding the number earns 1) and its state key, the range the hints leave open: states
recur whenever two episodes of a group narrow the range alike. `--env grid` takes GridWalk
instead (a small grid walked to its goal around holes, `progress_reward` per move gained; its
state is the cell, so states recur on nearly every step). Each run prints the share of steps
past an episode's first that acted from a state another step of its group acted from too (the
steps GiGPO's step level compares). `--warmup_episodes N` (GridWalk) first imitates N episodes
of random on-grid moves, so the RL steps go to choosing moves rather than learning to answer
with one. The policy is the tiny model
(2-layer Llama, hidden 64, built in-process), trained as examples/grpo_reference.py does (one
clipped policy-gradient step per batch, token-mean loss). Per method and seed it prints the
mean episode return of each step; the summary gives the mean of the last steps and the first
step whose 3-step moving average reaches the threshold, and each method's mean return over
all steps against outcome's, paired by seed, with its 95% interval.

    python benchmarks/step_credit.py                        # ~8 min on 2 busy cores
    python benchmarks/step_credit.py --steps 40 --seeds 0 1 2
    python benchmarks/step_credit.py --env grid --turns 8 --seeds 0 1 2 3
    python benchmarks/step_credit.py --env grid --turns 8 --warmup_episodes 64
    python benchmarks/step_credit.py --summarise run1.log run2.log   # seeds of both, paired
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from typing import Any

import gymnasium as gym
import torch
from machine import cpu_description  # benchmarks/machine.py
from torch import Tensor

import agentrl  # noqa: F401 - registers the env ids
from agentrl import algorithms as A
from agentrl.anchors import state_ids, state_visits
from agentrl.completion import SamplingParams
from agentrl.engine import create_engine
from agentrl.models.tiny import tiny_model, tiny_tokenizer
from agentrl.rollout import collect_sync
from agentrl.rollout.scripted import play_scripted
from agentrl.seeding import derive_seed
from agentrl.types import Trajectory, dense_group_ids
from environments.toy.grid import MOVES

METHODS = ("outcome", "rtg_turn", "gigpo")


def tensors(trajs: list[Trajectory], pad_id: int) -> dict[str, Tensor]:
    """ids/attention [B, T]; mask, and the rewards and state ids on each turn's last target
    [B, T-1]."""
    B, T = len(trajs), max(len(t.token_ids) for t in trajs)
    out = {"ids": torch.full((B, T), pad_id, dtype=torch.long),
           "attention": torch.zeros(B, T, dtype=torch.long), "mask": torch.zeros(B, T - 1),
           "rewards": torch.zeros(B, T - 1), "states": torch.zeros(B, T - 1, dtype=torch.long)}
    for b, traj in enumerate(trajs):
        n = len(traj.token_ids)
        out["ids"][b, :n], out["attention"][b, :n] = torch.tensor(traj.token_ids), 1
        out["mask"][b, : n - 1] = torch.tensor(traj.loss_mask[1:], dtype=torch.float32)
        for turn, state in zip(traj.turns, state_ids(traj), strict=True):
            if turn.end > turn.start:
                out["rewards"][b, turn.end - 2] += turn.reward
                out["states"][b, turn.end - 2] = state
    return out


def advantages(method: str, x: dict[str, Tensor], group_ids_B: Tensor) -> Tensor:
    if method == "outcome":
        return A.compute_advantages("group_norm", rewards_BT=x["rewards"], mask_BT=x["mask"],
                                    group_ids_B=group_ids_B)[0]
    # gigpo and rtg_turn: each step's end (and state) marked on its last action token.
    return A.compute_advantages(method, rewards_BT=x["rewards"], mask_BT=x["mask"],
                                group_ids_B=group_ids_B, state_ids_BT=x["states"])[0]


def make_env(args: argparse.Namespace, tok: Any) -> gym.Env:
    if args.env == "grid":
        return gym.make("agentrl/GridWalk-v0", tokenizer=tok, size=args.size,
                        max_moves=args.turns, holes=args.holes,
                        progress_reward=args.progress_reward)
    return gym.make("agentrl/GuessNumber-v0", tokenizer=tok, high=args.high,
                    max_guesses=args.turns, progress_reward=args.progress_reward)


def anchored_share(trajs: list[Trajectory], group_ids: list[int]) -> float:
    """The share of steps past an episode's first that acted from a state another step of the
    same group acted from too: the steps GiGPO's step level can compare."""
    counts = state_visits(trajs, group_ids)
    total = sum(counts.values())
    return sum(n for n in counts.values() if n >= 2) / total if total else 0.0


def random_moves(env: gym.Env, seed: int) -> gym.Env:
    """GridWalk whose scripted policy is a uniformly random move that stays on the grid (holes
    included): imitating it teaches the answer's form, not which move is good."""
    chat = env.unwrapped.chat_env  # type: ignore[attr-defined]
    rng = random.Random(seed)

    def on_the_grid() -> str:
        r, c = chat.cell
        return rng.choice([m for m, (dr, dc) in MOVES.items()
                           if 0 <= r + dr < chat.size and 0 <= c + dc < chat.size])

    chat.oracle_action = on_the_grid
    return env


def warm_start(seed: int, args: argparse.Namespace) -> dict[str, Tensor]:
    """The tiny model after imitating `--warmup_episodes` random-move episodes of GridWalk
    (`random_moves`) for `--warmup_epochs` epochs (token-mean NLL of the answers, batches of
    8): the weights every method of the seed starts from."""
    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=seed)
    if not args.warmup_episodes:
        return model.state_dict()
    played = play_scripted(lambda: random_moves(make_env(args, tok), seed),
                           [derive_seed(seed, "warmup", i) for i in range(args.warmup_episodes)],
                           max_turns=args.turns)
    trajs = played.trajectories
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    order = random.Random(derive_seed(seed, "warmup-order"))
    model.train()
    losses: list[float] = []
    for _ in range(args.warmup_epochs):
        picked = list(range(len(trajs)))
        order.shuffle(picked)
        for i in range(0, len(picked), 8):
            x = tensors([trajs[j] for j in picked[i : i + 8]], tok.pad_token_id)
            logits = model(input_ids=x["ids"], attention_mask=x["attention"]).logits[:, :-1]
            logp_BT = A.logprobs_from_logits(logits, x["ids"][:, 1:], 1.0)
            loss = -(logp_BT * x["mask"]).sum() / x["mask"].sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    print(f"seed {seed} warm-up: {len(trajs)} random-move episodes x {args.warmup_epochs} "
          f"epochs, answer NLL {losses[0]:.2f} -> {losses[-1]:.2f}", flush=True)
    return model.state_dict()


def train(method: str, seed: int, args: argparse.Namespace,
          start: dict[str, Tensor]) -> tuple[list[float], list[float]]:
    """Mean episode return of each step of one run from the weights `start`, and the share of
    anchored steps."""
    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=seed)
    model.load_state_dict(start)
    pad_id = tok.pad_token_id
    engine = create_engine(model, tokenizer=tok)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    returns: list[float] = []
    shares: list[float] = []
    for step in range(args.steps):
        model.eval()
        trajs = collect_sync(
            engine, lambda: make_env(args, tok),
            num_prompts=args.prompts, n_samples_per_prompt=args.group,
            sampling=SamplingParams(temperature=1.0, max_tokens=args.max_new_tokens,
                                    seed=derive_seed(seed, step)),
            seeds=[derive_seed(seed, "prompt", step * args.prompts + i)
                   for i in range(args.prompts)],
            group_prefix=f"s{step}-")
        model.train()
        x = tensors(trajs, pad_id)
        group_ids = dense_group_ids(trajs)
        adv_BT = advantages(method, x, torch.tensor(group_ids))
        logits = model(input_ids=x["ids"], attention_mask=x["attention"]).logits[:, :-1]
        logp_BT = A.logprobs_from_logits(logits, x["ids"][:, 1:], 1.0)
        loss_BT, _ = A.policy_loss("ppo", logp_BT=logp_BT, old_logp_BT=logp_BT.detach(),
                                   advantages_BT=adv_BT, mask_BT=x["mask"])
        loss = A.aggregate_loss(loss_BT, x["mask"], "token-mean", num_tokens=x["mask"].sum())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        engine.update_weights({}, step + 1)
        returns.append(sum(t.total_reward for t in trajs) / len(trajs))
        shares.append(anchored_share(trajs, group_ids))
    engine.close()
    return returns, shares


def steps_to(curve: list[float], threshold: float) -> int | None:
    """First step (1-based) whose 3-step moving average reaches `threshold`."""
    for i in range(2, len(curve)):
        if sum(curve[i - 2 : i + 1]) / 3 >= threshold:
            return i + 1
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=6, help="episodes per prompt")
    p.add_argument("--env", choices=("guess", "grid"), default="guess",
                   help="GuessNumber (--high, --turns guesses) or GridWalk (--size, --holes, "
                        "--turns moves)")
    p.add_argument("--high", type=int, default=16)
    p.add_argument("--size", type=int, default=4)
    p.add_argument("--holes", type=int, default=2)
    p.add_argument("--turns", type=int, default=4, help="guesses or moves per episode")
    p.add_argument("--progress_reward", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threshold", type=float, default=None,
                   help="return to reach (default: halfway from the first steps' mean to the "
                        "best final mean of any method)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--warmup_episodes", type=int, default=0,
                   help="--env grid: imitate this many episodes of random on-grid moves first "
                        "(the same warmed weights start every method of a seed)")
    p.add_argument("--warmup_epochs", type=int, default=2)
    p.add_argument("--summarise", nargs="+", metavar="LOG", default=None,
                   help="train nothing: summarise the curves these earlier runs printed "
                        "(e.g. two invocations with other seeds), paired by seed")
    args = p.parse_args()
    if args.summarise:
        summarise(read_curves(args.summarise), args.threshold)
        return
    if args.warmup_episodes and args.env != "grid":
        p.error("--warmup_episodes is for --env grid (GridWalk's random moves)")
    if args.warmup_episodes < 0 or args.warmup_epochs < 1:
        p.error("--warmup_episodes must be >= 0 and --warmup_epochs >= 1")
    torch.set_num_threads(2)
    print(f"machine: {cpu_description()}, torch threads {torch.get_num_threads()}")
    print(f"args: {json.dumps(vars(args))}")
    curves: dict[str, dict[int, list[float]]] = {m: {} for m in args.methods}
    anchored: dict[str, list[float]] = {m: [] for m in args.methods}
    t0 = time.perf_counter()
    for seed in args.seeds:
        start = warm_start(seed, args)
        for method in args.methods:
            t = time.perf_counter()
            c, share = train(method, seed, args, start)
            curves[method][seed] = c
            anchored[method].extend(share)
            print(f"{method:9s} seed {seed}: {' '.join(f'{r:.2f}' for r in c)}  "
                  f"({time.perf_counter() - t:.0f} s, anchored steps "
                  f"{sum(share) / len(share):.0%})", flush=True)
    print(f"total {time.perf_counter() - t0:.0f} s")
    summarise(curves, args.threshold, {m: sum(a) / len(a) for m, a in anchored.items()})


def summarise(curves: dict[str, dict[int, list[float]]], threshold: float | None,
              anchored: dict[str, float] | None = None) -> None:
    """Per method: the mean return of the last 5 steps, the steps to `threshold` (default:
    halfway from the first steps' mean to the best final mean), and against outcome, paired by
    seed, the difference of the mean return over all steps (the area under the learning curve:
    a method that learns sooner earns more of it) with its 95% interval (t at n - 1)."""
    tail = min(5, min(len(c) for cs in curves.values() for c in cs.values()))
    final = {m: statistics.mean(statistics.mean(c[-tail:]) for c in cs.values())
             for m, cs in curves.items()}
    start = statistics.mean(c[0] for cs in curves.values() for c in cs.values())
    if threshold is None:
        threshold = start + (max(final.values()) - start) / 2
    print(f"\nseeds {sorted(next(iter(curves.values())))}; first-step return {start:.3f}; "
          f"threshold {threshold:.3f}")
    base = curves.get("outcome")
    for m, cs in curves.items():
        reached = [steps_to(cs[s], threshold) for s in sorted(cs)]
        known = [r for r in reached if r is not None]
        mean_steps = f"{statistics.mean(known):.2f}" if known else "-"
        line = (f"{m:9s} last-{tail} mean return {final[m]:.3f}; steps to threshold per seed "
                f"{reached} (mean of those reached {mean_steps})")
        if anchored:
            line += f"; anchored steps {anchored[m]:.0%}"
        if base is not None and m != "outcome" and len(cs) > 1:
            diff = [statistics.mean(cs[s]) - statistics.mean(base[s]) for s in sorted(cs)]
            half = t_975(len(diff) - 1) * statistics.stdev(diff) / len(diff) ** 0.5
            line += (f"\n{'':9s} mean return over all steps vs outcome {statistics.mean(diff):+.4f}"
                     f" +- {half:.4f} (95%), higher on {sum(d > 0 for d in diff)} of "
                     f"{len(diff)} seeds")
        print(line)


T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Student's t, two-sided 95%, at 1-30 degrees of freedom (1.96 beyond)."""


def t_975(df: int) -> float:
    return T_975[df - 1] if df <= len(T_975) else 1.96


def read_curves(paths: list[str]) -> dict[str, dict[int, list[float]]]:
    """The per-seed curves printed by earlier runs of this script (their logs)."""
    curves: dict[str, dict[int, list[float]]] = {}
    line_re = re.compile(r"^(\w+)\s+seed (\d+): ([-\d. ]+?)\s+\(")
    for path in paths:
        with open(path) as f:
            for line in f:
                m = line_re.match(line)
                if m and m[1] in METHODS:
                    curves.setdefault(m[1], {})[int(m[2])] = [float(x) for x in m[3].split()]
    if not curves:
        raise SystemExit(f"no curves in {paths}: pass the logs this script printed")
    return curves

if __name__ == "__main__":
    main()
