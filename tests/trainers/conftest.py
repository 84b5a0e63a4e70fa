from __future__ import annotations

import dataclasses

import pytest

from trainers.presets import digits


def tiny_cfg(tmp_path, **overrides):
    """The digits preset (tiny model) in a temp run dir, no progress bar, no TensorBoard."""
    cfg = digits()
    sections = {k: overrides.pop(k) for k in ("actor", "algo", "rollout") if k in overrides}
    for name, changes in sections.items():
        overrides[name] = dataclasses.replace(getattr(cfg, name), **changes)
    base = dict(run_dir=str(tmp_path / "run"), use_ray=False, progress=False, tensorboard=False)
    return dataclasses.replace(cfg, **{**base, **overrides})


@pytest.fixture
def make_cfg(tmp_path):
    return lambda **kw: tiny_cfg(tmp_path, **kw)


@pytest.fixture(scope="session")
def recorded_rollouts(tmp_path_factory):
    """32 x 4 trajectories sampled once from the tiny model on Digits, saved as JSON lines."""
    from agentrl.engine import create_engine
    from agentrl.models import load_model, load_tokenizer
    from agentrl.types import save_jsonl
    from trainers.sampling import collect_for_step

    cfg = tiny_cfg(tmp_path_factory.mktemp("rec"))
    tok = load_tokenizer("tiny")
    engine = create_engine(load_model("tiny"), tokenizer=tok)
    trajs = []
    for step in range(4):
        seeds = list(range(step * 8, step * 8 + 8))
        trajs += collect_for_step(engine, cfg, tok, seeds, step)
    engine.close()
    path = tmp_path_factory.mktemp("rec") / "rollouts.jsonl"
    save_jsonl(trajs, path)
    return path
