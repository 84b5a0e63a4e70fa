"""Config errors surface before any model loads, naming the flags."""

from __future__ import annotations

import json

import pytest

from trainers.cli import build_config, main
from trainers.config import TrainConfig, config_from_dict

# Two ranks, placed rollouts; append the backend name.
DATA_PARALLEL = ["--env", "digits", "--num_policy_workers", "2", "--rollout.mode", "placed",
                 "--backend"]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["--env", "digits", "--rollout.n_samples_per_prompt", "1"],
            r"group_norm needs a group: set --rollout.n_samples_per_prompt >= 2",
        ),
        (
            ["--env", "digits", "--algo.estimator", "grpo_norm"],
            r"--algo.estimator 'grpo_norm' is unknown. Did you mean 'group_norm'",
        ),
        (
            ["--env", "digits", "--minibatches_per_step", "3"],
            r"--minibatches_per_step 3 must divide the rollout batch .* = 32",
        ),
        (
            ["--env", "digits", "--rollout.async_depth", "1"],
            r"async_depth > 0 needs --rollout.mode placed",
        ),
        (
            [*DATA_PARALLEL, "deepspeed", "--zero_stage", "4"],
            r"--zero_stage must be 1, 2 or 3 \(.*\), got 4",
        ),
        (["--env", "digits", "--backend", "fsdp"],
         r"--backend 'fsdp' is unknown. Did you mean 'fsdp2'"),
        (["--env", "digits", "--actor.device", "gpu"],
         r"--actor.device 'gpu' is not a device: use auto, cpu, cuda or cuda:N"),
        (["--env", "digits", "--backend", "cpu", "--actor.device", "cuda"],
         r"--backend cpu .* use --backend local \(or auto\) on a GPU"),
        (["--env", "digits", "--rollout.max_turns", "0"],
         r"--rollout.max_turns must be an integer >= 1 \(or unset for no limit\), got 0"),
        (["--env", "digits", "--rollout.max_episode_tokens", "-5"],
         r"--rollout.max_episode_tokens must be an integer >= 1 .*got -5"),
        (["--env", "digits", "--eval_every", "5"],
         r"--eval_every 5 needs held-out problems to evaluate: set --eval_problems N"),
        (["--env", "digits", "--eval_every", "5", "--eval_problems", "8", "--keep_best", "pass@2"],
         (r"--keep_best 'pass@2' is not an eval metric. Did you mean 'pass@1'\? Choose one of: "
          r"pass@1, mean_return")),
        (["--env", "digits", "--eval_problems", "8", "--keep_best", "mean_return"],
         (r"--keep_best mean_return compares the checkpoints of periodic evals: set "
          r"--eval_every N")),
        (["--env", "digits", "--keep_last", "0"], r"--keep_last must be >= 1 .*got 0"),
        (
            ["--env", "digits", "--algo.policy_loss", "cispo", "--algo.clip_low", "0",
             "--algo.clip_high", "0"],
            (r"--algo.clip_low=0 and --algo.clip_high=0 give CISPO the clip range .* = \[1, 1\], "
             r"which is empty"),
        ),
        (
            ["--env", "digits", "--algo.policy_loss", "cispo", "--algo.clip_low", "-0.5",
             "--algo.clip_high", "0.2"],
            (r"--algo.clip_low=-0.5 and --algo.clip_high=0.2 give CISPO the clip range .* = "
             r"\[1.5, 1.2\], which is inverted"),
        ),
        (
            ["--env", "digits", "--algo.policy_loss", "cispo", "--algo.clip_high", "-1.5"],
            (r"--algo.clip_low=1 and --algo.clip_high=-1.5 give CISPO the clip range .* = "
             r"\[0, -0.5\], which is inverted"),
        ),
        (
            ["--env", "digits", "--algo.policy_loss", "cispo", "--algo.dual_clip", "3"],
            r"cispo has no such term .* leave --algo.dual_clip unset",
        ),
    ],
)
def test_conflicting_flags_fail_before_loading(argv, match, monkeypatch):
    from agentrl import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model was loaded"))
    with pytest.raises(ValueError, match=match):
        build_config(argv)


def test_a_device_that_is_not_there_fails_before_loading(make_cfg, monkeypatch):
    import torch

    from agentrl import models
    from trainers.policy import PolicyWorker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model was loaded"))
    with pytest.raises(ValueError, match=r"--actor.device cuda: no CUDA device is visible .* use "
                                         r"--actor.device cpu"):
        PolicyWorker(make_cfg(actor={"device": "cuda"}), with_engine=False)


def test_deepspeed_without_its_package_says_what_to_install(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else find(name, *a))
    with pytest.raises(ValueError, match=r"--backend deepspeed needs the deepspeed package: pip"):
        build_config([*DATA_PARALLEL, "deepspeed"])


@pytest.mark.parametrize(
    ("backend", "extra"), [("fsdp2", []), ("deepspeed", ["--zero_stage", "3"])]
)
def test_data_parallel_backends_take_the_critic_and_zero3(backend, extra):
    cfg = build_config([*DATA_PARALLEL, backend, "--algo.estimator", "gae", *extra])
    assert (cfg.backend, cfg.algo.estimator, cfg.num_policy_workers) == (backend, "gae", 2)
    assert cfg.zero_stage == (3 if extra else 2)


@pytest.mark.parametrize(
    ("backend", "extra", "shards_the_base"),
    [("fsdp2", [], True), ("deepspeed", ["--zero_stage", "3"], True),
     ("deepspeed", ["--zero_stage", "2"], False)],
)
def test_lora_takes_data_parallel_ranks_but_a_4bit_base_is_not_sharded(backend, extra,
                                                                       shards_the_base):
    lora = [*DATA_PARALLEL, backend, *extra, "--actor.lora_rank", "8"]
    assert build_config(lora).actor.lora_rank == 8
    qlora = [*lora, "--actor.load_in_4bit", "true"]
    if not shards_the_base:
        assert build_config(qlora).actor.load_in_4bit
        return
    with pytest.raises(ValueError, match=r"--actor.load_in_4bit \(QLoRA\) with "
                                         r"--num_policy_workers > 1: --backend .* shards every "
                                         r"weight.* use --backend deepspeed --zero_stage 2"):
        build_config(qlora)


def test_cli_prints_error_and_returns_2(capsys):
    assert main(["--env", "digits", "--algo.estimator", "nope"]) == 2
    assert "--algo.estimator 'nope' is unknown" in capsys.readouterr().err


def test_precedence_flags_over_file_over_preset(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"env": "digits", "steps": 7, "actor": {"lr": 0.5}}))
    cfg = build_config(["--config", str(path), "--actor.lr", "0.25"])
    assert (cfg.env, cfg.steps, cfg.actor.lr, cfg.actor.model) == ("digits", 7, 0.25, "tiny")
    # The saved resolved config loads back to the same thing.
    cfg.save(tmp_path / "resolved.json")
    again = config_from_dict(json.loads((tmp_path / "resolved.json").read_text()))
    assert again == cfg


def test_unknown_config_key_says_did_you_mean():
    with pytest.raises(
        ValueError, match=r"unknown config key 'actor.lrr'; did you mean 'actor.lr'"
    ):
        config_from_dict({"actor": {"lrr": 1}})


def test_default_is_math_tir_preset():
    cfg = build_config([])
    assert cfg.env == "math-tir" and cfg.actor.model == "smollm2-135m-instruct"
    assert cfg.eval_problems > 0 and cfg == TrainConfig(**cfg.__dict__)
    # #20: it trains on easy and medium problems and is judged on held-out medium ones, with
    # at least 64 samples.
    assert cfg.env_kwargs["difficulty"] == "easy,medium"
    assert cfg.eval_env_kwargs == {"split": "eval", "difficulty": "medium"}
    assert cfg.eval_problems * cfg.eval_samples >= 64 and cfg.eval_temperature == 1.0


def test_presets_by_name():
    easy = build_config(["--preset", "math-tir-easy", "--steps", "3"])
    assert easy.env == "math-tir" and easy.env_kwargs["difficulty"] == "easy"
    assert easy.eval_env_kwargs == {"split": "eval"} and easy.steps == 3
    with pytest.raises(ValueError, match="--preset 'math-tir-hard' is not a preset; choose one "
                                         "of .*math-tir-easy"):
        build_config(["--preset", "math-tir-hard"])


def test_boolean_flags_take_any_case_and_strings_stay_as_typed():
    cfg = build_config(["--env", "digits", "--use_ray", "false", "--share_prefixes=FALSE",
                        "--actor.gradient_checkpointing", "true", "--run_dir", "false"])
    assert (cfg.use_ray, cfg.share_prefixes, cfg.actor.gradient_checkpointing) == (
        False, False, True)
    assert cfg.run_dir == "false"  # a string field keeps its value
    cfg = build_config(["--env", "digits", "--use_ray", "True"])
    assert cfg.use_ray is True


@pytest.mark.parametrize(
    ("changes", "gpus", "match"),
    [
        ({"actor": {"device": "cuda"}}, 0, r"--actor.device cuda: no CUDA device is visible"),
        ({"rollout": {"engine": "vllm", "tensor_parallel_size": 4}}, 2,
         r"--rollout.tensor_parallel_size 4 is more than the 2 GPUs visible; use at most 2"),
    ],
)
def test_machine_checks_run_before_any_model_loads(make_cfg, changes, gpus, match, monkeypatch):
    import importlib.util

    from trainers.controller import preflight

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as if vllm were installed
                        lambda name, *a: object() if name == "vllm" else find(name, *a))
    with pytest.raises(ValueError, match=match):
        preflight(make_cfg(**changes), gpus)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--rollout.engine", "vlm"], r"--rollout.engine 'vlm' is not an engine. Did you mean"),
        (["--rollout.tensor_parallel_size", "2"],
         r"--rollout.tensor_parallel_size > 1 and --rollout.enable_sleep need --rollout.engine"),
    ],
)
def test_engine_flags_are_checked(argv, match):
    with pytest.raises(ValueError, match=match):
        build_config(["--env", "digits", *argv])


def test_vllm_without_its_package_says_what_to_install(monkeypatch):
    import importlib.util
    import sys

    find = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else find(name, *a))
    with pytest.raises(ValueError, match=r"--rollout.engine vllm: the vllm package is not "
                                         r"installed; `make setup` installs"):
        build_config(["--env", "digits", "--rollout.engine", "vllm"])
