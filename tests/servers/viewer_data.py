"""Runs for the viewer's tests and benchmark: a small one written by the library's own writer
(`save_jsonl`, as the trainer writes rollouts) with every case the page must show, and a
synthetic 10,000-episode one written fast, line by line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from agentrl.trajectory_files import save_jsonl
from agentrl.types import Image, Trajectory, TrajectoryBuilder

PAYLOAD = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
"""What a tool returned: it must show as text and never run."""


def small_run(root: Path, tok: object) -> Path:
    """A run directory in the trainer's layout: 2 steps, a group of 4 with distinct rewards, a
    tool call and a tool output carrying `PAYLOAD`, a screenshot, a discarded episode, a drift
    segment, a corrupt line and (in step 2) a half-written last line; config.json names the
    tiny tokenizer and group_norm."""
    run = root / "run"
    (run / "rollouts").mkdir(parents=True)
    enc = tok.encode  # type: ignore[attr-defined]
    trajs = []
    for k, reward in enumerate((1.0, 0.0, 0.5, 0.0)):
        b = TrajectoryBuilder(group="s0-0")
        b.add_observation(enc("user: add 2 and 3\n"))
        call = enc('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
        b.add_action(call, [-0.1 * (i % 7) for i in range(len(call))], policy_version=3)
        pixels = np.zeros((24, 32, 3), np.uint8)
        pixels[:, :, k % 3] = 200
        shot = Image(pixels=pixels, start=len(b.token_ids), end=len(b.token_ids))
        b.add_observation(enc(f"tool: {PAYLOAD}\n"), [shot])
        answer = enc(f"the sum is {k + 4}")
        b.add_action(answer, [-0.05 * i for i in range(len(answer))], policy_version=4,
                     version_changes=[(2, 5)])
        b.turns[-1].reward = reward
        info = {"task": "adder", "format": 0.25 * k, "prompt_index": 0}
        trajs.append(b.build(terminated=True, truncated=False, info=info))
    bad = TrajectoryBuilder(group="s0-1")
    bad.add_observation(enc("user: hi\n"))
    bad.add_action(enc("hello"), [-1.0] * len(enc("hello")))
    trajs.append(bad.build(terminated=False, truncated=True, discard=True,
                           info={"error": "SandboxError('bwrap failed')", "task": "greeter"}))
    for seg, cause in enumerate(("start", "drift")):
        d = TrajectoryBuilder(group="s0-2")
        d.add_observation(enc(f"user: segment {seg}\n"))
        d.add_action(enc("ok"), [-0.5, -0.5])
        trajs.append(d.build(terminated=seg == 1, truncated=False, info={
            "episode": "sess-1", "segment": seg, "segment_cause": cause,
            "drift": cause == "drift", "task": "chatter"}))
    save_jsonl(trajs, run / "rollouts" / "step_000001.jsonl")
    with (run / "rollouts" / "step_000001.jsonl").open("a") as f:
        f.write('{"uid": "torn", "token_ids": [1, 2\n')  # a corrupt line: file line 8
    save_jsonl(trajs[:2], run / "rollouts" / "step_000002.jsonl")
    with (run / "rollouts" / "step_000002.jsonl").open("a") as f:
        f.write(trajs[2].to_json()[:100])  # still being written: no newline
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "reward": 0.375, "mismatch": 0.0012, "kl": 0.01}) + "\n"
        + '{"step": 2, "rew')  # a metrics line still being written
    (run / "config.json").write_text(json.dumps(
        {"env": "adder-v0", "actor": {"model": "tiny"}, "algo": {"estimator": "group_norm"}}))
    return run


def big_run(root: Path, *, episodes: int = 10_000, per_step: int = 400, group: int = 8,
            seed: int = 0) -> Path:
    """A synthetic run of `episodes` two-turn episodes (250 tokens each) over steps of
    `per_step`, written as JSON lines directly (a second or two, not a trainer's minutes):
    64 token bodies, each episode one of them with its own uid, group, reward and task."""
    rng = random.Random(seed)
    run = root / "big"
    (run / "rollouts").mkdir(parents=True)
    bodies = [_synthetic_body(rng) for _ in range(64)]
    with (run / "metrics.jsonl").open("w") as metrics:
        for step in range(1, episodes // per_step + 1):
            lines = []
            for e in range(per_step):
                discard = e % 97 == 0
                info = {"task": f"task-{e % 5}", "prompt_index": e // group}
                if discard:
                    info["error"] = "EnvTimeoutError('step')"
                lines.append(bodies[rng.randrange(64)].format(
                    uid=f"{step}-{e}", group=f"s{step}-{e // group}", v=step - 1,
                    reward=float(rng.random() < 0.4), info=json.dumps(info),
                    discard=', "discard": true' if discard else ""))
            (run / "rollouts" / f"step_{step:06d}.jsonl").write_text("".join(lines))
            metrics.write(json.dumps({"step": step, "reward": rng.random(), "kl": 0.01,
                                      "mismatch": 1e-3, "entropy": 2.0}) + "\n")
    (run / "config.json").write_text(json.dumps(
        {"env": "synthetic", "actor": {"model": "tiny"}, "algo": {"estimator": "group_norm"}}))
    return run


SYNTHETIC_LENGTHS = (60, 80, 30, 80)
"""A synthetic episode: prompt, action, tool output, action (tokens)."""


def _synthetic_body(rng: random.Random) -> str:
    """One record as a format string (uid, group, v, reward, info, discard to fill in)."""
    lens = SYNTHETIC_LENGTHS
    token_ids = [rng.randrange(3, 380) for _ in range(sum(lens))]
    mask = [0] * lens[0] + [1] * lens[1] + [0] * lens[2] + [1] * lens[3]
    logprobs = [round(-rng.expovariate(2.0), 4) if m else 0.0 for m in mask]
    a, b, c = lens[0], lens[0] + lens[1], lens[0] + lens[1] + lens[2]
    fixed = json.dumps({"token_ids": token_ids, "loss_mask": mask, "logprobs": logprobs})
    turn = ('{{{{"obs_start": {o}, "start": {s}, "end": {e}, "reward": {r}, '
            '"policy_version": {{v}}, "finish_reason": "stop"}}}}')
    turns = "[" + ", ".join((turn.format(o=0, s=a, e=b, r="0.0"),
                             turn.format(o=b, s=c, e=c + lens[3], r="{reward}"))) + "]"
    body = fixed[1:-1].replace("{", "{{").replace("}", "}}")
    return ('{{"uid": "{uid}", "group": "{group}", ' + body + ', "turns": ' + turns
            + ', "terminated": true, "truncated": false, "images": [], "info": {info}{discard}}}\n')


def trajectory_of(path: Path, line: int) -> Trajectory:
    """The record on file line `line` (1-based) of a JSONL file, as the library reads it."""
    with path.open() as f:
        for i, text in enumerate(f, 1):
            if i == line:
                return Trajectory.from_json(text, path.parent / "images")
    raise KeyError(line)
