"""A preset's hyperparameters belong to its model (#34 item 14): `--actor.model` takes the
learning rate the preset measured for that model, and a model it was not measured on needs
--actor.lr."""

from __future__ import annotations

import dataclasses
import json

import pytest

from trainers.cli import build_config


def test_the_learning_rate_follows_the_model():
    tiny = build_config(["--env", "digits"]).actor.lr
    embedded = build_config(["--env", "digits", "--actor.model", "smollm2-135m-instruct"]).actor.lr
    # The tiny model's rate collapses the embedded model's entropy (3.3 -> 0.8 in one step).
    assert tiny == 3e-3 and embedded <= tiny / 10
    from trainers.presets import DIGITS_LRS, MATH_TIR_LRS

    assert (DIGITS_LRS["tiny"], DIGITS_LRS["smollm2-135m-instruct"]) == (tiny, embedded)
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", "embedded"):  # its aliases
        cfg = build_config(["--env", "digits", "--actor.model", name])
        assert (cfg.actor.model, cfg.actor.lr) == (name, embedded)
    # A rate given by flag wins (by --config file too: below).
    assert build_config(["--env", "digits", "--actor.model", "embedded",
                         "--actor.lr=0.01"]).actor.lr == 0.01
    assert build_config(["--env", "math-tir", "--actor.model", "embedded"]).actor.lr == (
        MATH_TIR_LRS["smollm2-135m-instruct"])


def test_a_model_the_preset_was_not_measured_on_needs_a_learning_rate(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^the digits preset's learning rate was measured with "
                                         r"tiny \(--actor.lr 0.003\) and smollm2-135m-instruct "
                                         rf"\(--actor.lr .*\) only; --actor.model {model} needs "
                                         r"--actor.lr too"):
        build_config(["--env", "digits", "--actor.model", str(model)])
    with pytest.raises(ValueError, match=r"the math-tir-easy preset's learning rate was measured "
                                         r"with smollm2-135m-instruct \(--actor.lr 1e-05\) only; "
                                         r"--actor.model tiny needs --actor.lr"):
        build_config(["--preset", "math-tir-easy", "--actor.model", "tiny"])
    cfg = build_config(["--env", "digits", "--actor.model", str(model), "--actor.lr", "1e-4"])
    assert (cfg.actor.model, cfg.actor.lr) == (str(model), 1e-4)
    # In a --config file: the model alone is refused, the model with its rate taken.
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"env": "math-tir", "actor": {"model": "tiny"}}))
    with pytest.raises(ValueError, match="--actor.model tiny needs --actor.lr too"):
        build_config(["--config", str(path)])
    path.write_text(json.dumps({"env": "math-tir", "actor": {"model": "tiny", "lr": 1e-3}}))
    assert build_config(["--config", str(path)]).actor.lr == 1e-3


def test_the_miniwob_preset_is_the_web_agent_headline():
    from environments.miniwob.tasks import resolve_tasks
    from trainers.presets import MINIWOB_LRS

    cfg = build_config(["--preset", "miniwob"])
    for name in ("miniwob", "agentrl/MiniWoB-v0"):  # --env picks the preset too
        assert dataclasses.replace(build_config(["--env", name]), env="miniwob") == cfg
    tasks = resolve_tasks(str(cfg.env_kwargs["task"]))
    assert len(tasks) >= 6 and "enter-text" in tasks
    assert (cfg.env_kwargs["observation"], cfg.env_kwargs["split"]) == ("dom", "train")
    assert cfg.eval_env_kwargs == {"split": "eval"}  # held-out page seeds
    # Every task gets the same number of held-out pages (problem i is task i mod n), sampled.
    assert cfg.eval_problems % len(tasks) == 0 and cfg.eval_problems // len(tasks) >= 8
    assert (cfg.eval_samples, cfg.eval_temperature) == (1, 1.0)
    assert (cfg.algo.estimator, cfg.actor.lr) == ("group_norm", MINIWOB_LRS[cfg.actor.model])
    # One browser per episode in flight: bounded for a 2-core machine; actions are short.
    assert cfg.rollout.max_concurrency <= 16 and cfg.rollout.max_new_tokens <= 32
    assert cfg.rollout.max_turns is not None and cfg.rollout.max_turns <= 3
