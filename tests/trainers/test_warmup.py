"""The supervised warm-up before RL (--warmup.*): the env's scripted episodes are played,
saved and imitated, the sampler then follows the new weights, the run evaluates after the
warm-up too, and what cannot work is refused before any eval or update."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agentrl.rollout.scripted import NoScriptedPolicyError
from agentrl.trajectory_files import load_jsonl
from trainers.config import WarmupConfig
from trainers.controller import Trainer


def _answer_logprob(model, tok, traj) -> float:
    """The model's log-prob of a trajectory's action tokens."""
    ids = torch.tensor([traj.token_ids])
    with torch.no_grad():
        logp = model(ids).logits[0, :-1].float().log_softmax(-1)
    picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
    mask = torch.tensor(traj.loss_mask[1:], dtype=torch.bool)
    return float(picked[mask].sum())


def test_the_policy_imitates_the_scripted_episodes_then_trains(make_cfg, tiny_tokenizer):
    """Digits' scripted policy counts on in digits: after the warm-up the policy gives those
    answers a higher log-prob, and the sampler (the colocated engine) writes more digits:
    the held-out return after the warm-up is above the one before."""
    from agentrl.models import load_model

    cfg = make_cfg(warmup=WarmupConfig(episodes=16, epochs=8, batch_size=8), steps=1,
                   eval_problems=16, eval_temperature=0.0)
    summary = Trainer(cfg).run()
    run = Path(cfg.run_dir)
    played = load_jsonl(run / "warmup.jsonl")
    assert len(played) == 16 and all(t.turns[0].reward == 1.0 for t in played)
    w = summary["warmup"]
    assert w["optimizer_steps"] == 16 and w["episodes"] == 16
    assert w["loss_last_epoch"] < 0.6 * w["loss_first_epoch"]
    before = load_model("tiny")  # the same seed's weights the run started from
    after = load_model(summary["hf_model"])
    assert (_answer_logprob(after, tiny_tokenizer, played[0])
            > _answer_logprob(before, tiny_tokenizer, played[0]) + 1.0)
    assert summary["eval_warmup"]["mean_return"] > summary["eval_before"]["mean_return"] + 0.2
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("warmup/loss_last_epoch" in row for row in logged)
    assert any("eval_warmup/pass@1" in row for row in logged)
    from trainers.plot import plot_run  # the eval curve: before, after the warm-up, after

    assert "eval_mean_return.png" in {p.name for p in plot_run(run, ("eval/mean_return",))}


def test_the_warmup_env_kwargs_override_the_training_envs(make_cfg):
    """--warmup.env_kwargs apply to the scripted episodes only (digits' `turns`)."""
    cfg = make_cfg(warmup=WarmupConfig(episodes=2, env_kwargs={"turns": 3}), steps=0)
    Trainer(cfg).run()
    assert [len(t.turns) for t in load_jsonl(Path(cfg.run_dir) / "warmup.jsonl")] == [3, 3]


def test_an_env_without_a_scripted_policy_is_refused_before_any_eval(make_cfg):
    cfg = make_cfg(env="agentrl/Reverse-v0", warmup=WarmupConfig(episodes=4), eval_problems=4,
                   steps=1)
    with pytest.raises(NoScriptedPolicyError, match="ReverseEnv has no scripted policy"):
        Trainer(cfg).run()
    assert not (Path(cfg.run_dir) / "eval_before.jsonl").exists()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"warmup": {"episodes": -1}}, "--warmup.episodes must be >= 0"),
    ({"warmup": {"episodes": 4, "epochs": 0}}, "--warmup.epochs"),
    ({"warmup": {"episodes": 4}, "algo": {"kl_coef": 0.1}}, "KL reference would be the model"),
])
def test_bad_warmup_flags_are_refused_with_the_flag(make_cfg, overrides, message):
    warmup = overrides.pop("warmup")
    with pytest.raises(ValueError, match=message):
        make_cfg(warmup=WarmupConfig(**warmup), **overrides)


def test_warmup_flags_parse_from_the_command_line():
    """A preset's warm-up arguments are flags, as its env's are."""
    from trainers.cli import build_config

    cfg = build_config(["--preset", "miniwob", "--warmup.episodes", "8",
                        "--warmup.env_kwargs.task", "click-test-2"])
    assert cfg.warmup.episodes == 8
    assert cfg.warmup.env_kwargs == {"task": "click-test-2", "max_turns": 3}
