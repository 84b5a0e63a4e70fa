"""`agentrl train` refuses a model that cannot work with its engine or env in one line naming the
flags and the fix, before Ray or any model starts (#34 item 14)."""

from __future__ import annotations

import pytest

from trainers.cli import main

VLLM_EMBEDDED = ["--rollout.engine", "vllm", "--actor.model", "smollm2-135m-instruct"]


@pytest.fixture
def nothing_starts(monkeypatch):
    """vLLM as if installed; starting Ray or loading a model fails the test."""
    import importlib.util

    import ray

    from agentrl import models

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find(name, *a))
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--env", "digits", "--rollout.engine", "vllm"],
         ("--rollout.engine vllm loads the model from a directory, but --actor.model tiny is "
          "built in memory and has none: use --actor.model smollm2-135m-instruct (the embedded "
          "model)")),
        (["--env", "screen-click", "--actor.model", "smollm2-135m-instruct", "--actor.lr", "1e-5"],
         ("--env screen-click shows images, but --actor.model smollm2-135m-instruct is a "
          "text-only model: use --actor.model embedded-vlm")),
        (["--env", "digits", *VLLM_EMBEDDED, "--rollout.enable_sleep", "true",
          "--actor.device", "cpu"],
         ("--rollout.enable_sleep is vLLM's CUDA sleep mode, but --actor.device is cpu: drop "
          "--rollout.enable_sleep")),
        (["--env", "digits", "--actor.model", "smollm3"],
         "--actor.model: unknown model 'smollm3'. Did you mean"),
        (["--env", "digitz"], "unknown environment 'digitz'. Did you mean 'digits'?"),
    ],
)
def test_a_model_that_cannot_work_is_refused_before_ray_starts(argv, says, nothing_starts,
                                                              tmp_path, capsys):
    assert main([*argv, "--run_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "run").exists()


def test_vllm_with_a_model_it_loads_passes_the_checks(nothing_starts):
    from trainers.cli import build_config

    cfg = build_config(["--env", "digits", *VLLM_EMBEDDED])
    assert (cfg.rollout.engine, cfg.actor.model) == ("vllm", "smollm2-135m-instruct")


def test_a_trainer_built_in_python_gets_the_same_refusal_before_ray(tmp_path, monkeypatch):
    """`Trainer(cfg).run()` (no CLI) checks the model too, before Ray or any worker starts."""
    import ray

    from trainers.config import ActorConfig, RolloutConfig, TrainConfig
    from trainers.controller import Trainer

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    cfg = TrainConfig(env="digits", actor=ActorConfig(model="tiny"),
                      rollout=RolloutConfig(engine="vllm"), run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="--actor.model smollm2-135m-instruct"):
        Trainer(cfg).run()
    assert not (tmp_path / "run").exists()


def test_an_env_that_cannot_be_built_here_is_refused_before_ray(nothing_starts, tmp_path,
                                                                  capsys):
    """An env class's `preflight(**env_kwargs)` (MiniWoB: browser installed, task names) runs
    in the checks: its error is the command's one line, before Ray or a model starts."""
    import agentrl

    class NeedsABrowser(agentrl.ChatEnv):
        @staticmethod
        def preflight(**kwargs):
            raise RuntimeError(f"no browser for {kwargs}: apt-get install -y chromium")

        def reset(self, *, seed=None, options=None):
            return [{"role": "user", "content": "hi"}]

        def step(self, text):
            return [], 0.0, True, False, {}

    agentrl.register("test/NeedsABrowser-v0", NeedsABrowser)
    argv = ["--env", "test/NeedsABrowser-v0", "--actor.model", "tiny"]
    assert main([*argv, "--run_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--env test/NeedsABrowser-v0: no browser for {}: apt-get install -y chromium" in err
