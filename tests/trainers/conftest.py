from __future__ import annotations

import dataclasses

import pytest

from trainers.presets import digits


def tiny_cfg(tmp_path, **overrides):
    """The digits preset (tiny model) in a temp run dir, no progress bar, no TensorBoard."""
    cfg = digits()
    sections = {k: overrides.pop(k) for k in ("actor", "algo", "rollout", "ray")
                if k in overrides}
    for name, changes in sections.items():
        overrides[name] = dataclasses.replace(getattr(cfg, name), **changes)
    base = {"run_dir": str(tmp_path / "run"), "use_ray": False, "progress": False,
            "tensorboard": False}
    return dataclasses.replace(cfg, **{**base, **overrides})


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A private local Ray cluster (2 CPUs) for the tests of one module: started once, as
    starting one costs seconds; trainers that find it running leave it up."""
    import os

    from trainers.ray_utils import init_ray, shutdown_ray

    os.environ["AGENTRL_RAY_TMP"] = str(tmp_path_factory.mktemp("ray"))
    init_ray(num_cpus=2)
    yield
    shutdown_ray()  # and its reaper ends Ray's agents, so none outlives the module


@pytest.fixture
def make_cfg(tmp_path):
    return lambda **kw: tiny_cfg(tmp_path, **kw)


@pytest.fixture(params=["kernels_on", "kernels_off"])
def cpu_kernels(request, monkeypatch):
    """Run the test twice: with agentrl's compiled CPU kernels forced on (every family: decode,
    fused norm/gating, fused log-prob/entropy, whatever calibration chose for this CPU) and
    forced off (`AGENTRL_CPU_KERNELS=1` / `0`). The value is True when on. The forced-on run
    skips, with the reason, where the kernels cannot be built. For the tests that reach the
    kernels' code paths; the rest run with the calibrated choice (or the one the environment
    forces for the whole run), as does a test parametrised indirectly with "calibrated"."""
    from agentrl.backends.cpu import kernels

    if request.param == "calibrated":
        return None
    on = request.param == "kernels_on"
    monkeypatch.setenv(kernels.ENV, "1" if on else "0")
    if on and kernels.module() is None:
        pytest.skip(f"agentrl's CPU kernels could not be built here: {kernels.build_error}")
    return on


@pytest.fixture(scope="session")
def recorded_rollouts(tmp_path_factory):
    """32 x 4 trajectories sampled once from the tiny model on Digits, saved as JSON lines. Sampled
    without the CPU kernels: the same data whichever test asks first, on every CPU."""
    from agentrl.backends.cpu import kernels
    from agentrl.engine import create_engine
    from agentrl.models import load_model, load_tokenizer
    from agentrl.trajectory_files import save_jsonl
    from trainers.episodes import collect_for_step

    cfg = tiny_cfg(tmp_path_factory.mktemp("rec"))
    tok = load_tokenizer("tiny")
    trajs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.ENV, "0")
        engine = create_engine(load_model("tiny"), tokenizer=tok)
        for step in range(4):
            seeds = list(range(step * 8, step * 8 + 8))
            trajs += collect_for_step(engine, cfg, tok, seeds, step)
        engine.close()
    path = tmp_path_factory.mktemp("rec") / "rollouts.jsonl"
    save_jsonl(trajs, path)
    return path
