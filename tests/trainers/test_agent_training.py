"""Training from proxy sessions: a black-box agent (the real openai client) drives the
recording proxy; its token-exact trajectories feed the same update as env rollouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainers.controller import Trainer


@pytest.mark.slow
def test_agent_through_proxy_trains(make_cfg, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"Count from {i}. Digits only."}) + "\n"
                             for i in range(16)))
    cfg = make_cfg(
        steps=12, agent="tests.trainers.agent_fixture:digits_agent",
        agent_tasks=str(tasks), agent_reward="tests.trainers.agent_fixture:digits_reward",
    )
    Trainer(cfg).run()
    rows = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward" in r]
    assert len(rows) == 12
    # Every episode was recorded token-exact with sampler logprobs, so the mismatch between
    # sampler and trainer logprobs stays tiny (fp32, same weights).
    assert all(abs(r["mismatch"]) < 1e-3 for r in rows)
    assert all(r["response_tokens"] > 0 for r in rows)
    first = sum(r["reward"] for r in rows[:4]) / 4
    last = sum(r["reward"] for r in rows[-4:]) / 4
    assert last > first, (first, last)


def test_agent_flags_must_come_together(make_cfg):
    with pytest.raises(ValueError, match="--agent needs --agent_tasks"):
        make_cfg(agent="x:y")


@pytest.mark.slow
def test_an_agent_sending_screenshots_trains_a_vision_language_model(make_cfg, tmp_path):
    """An external agent sends image_url parts through the proxy: its sessions are recorded with
    their screenshots (stored once as PNG beside the rollouts) and the trainer scores exactly
    what the engine sampled, images included."""
    from agentrl.types import Trajectory

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"seed": i}) + "\n" for i in range(4)))
    cfg = make_cfg(
        steps=2, actor={"model": "tiny-qwen2-vl"},
        agent="tests.trainers.agent_fixture:screen_agent", agent_tasks=str(tasks),
        agent_reward="tests.trainers.agent_fixture:digits_reward",
    )
    Trainer(cfg).run()
    rows = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward" in r]
    assert len(rows) == 2 and all(abs(r["mismatch"]) < 1e-4 for r in rows)
    files = sorted((Path(cfg.run_dir) / "rollouts").glob("*.jsonl"))
    trajs = [Trajectory.from_json(line, image_dir=files[0].parent / "images")
             for f in files for line in f.read_text().splitlines()]
    # A session is one trajectory of two turns, or two segments where the random policy's
    # answer did not re-render to its own tokens (drift); the second call's prompt carries both
    # screenshots either way.
    assert trajs and all(1 <= len(t.turns) <= 2 and len(t.images) in (1, 2) for t in trajs)
    assert any(len(t.images) == 2 for t in trajs)
    assert len(list((files[0].parent / "images").glob("*.png"))) >= 4
