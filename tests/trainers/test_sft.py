"""`agentrl sft`: the tokens trained are a rollout's, the loss is on assistant tokens only, the
held-out loss falls, trajectories filter by reward, resume is exact, bad data is reported."""

from __future__ import annotations

import json
import random

import pytest
import torch

from agentrl.cli import main
from agentrl.trajectory_files import save_jsonl
from agentrl.types import TrajectoryBuilder
from trainers.sft import SFTConfig, SFTTrainer, chat_trajectory, load_sft_data, run_sft

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "rocket"]


def _chats(path, n=120, seed=0):
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            w = " ".join(rng.choice(WORDS) for _ in range(3))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Repeat: {w}"},
                                             {"role": "assistant", "content": w}]}) + "\n")
    return path


def _cfg(tmp_path, **kw):
    from trainers.config import ActorConfig

    base = {"actor": ActorConfig(model="tiny", lr=1e-3), "run_dir": str(tmp_path / "run"),
            "progress": False, "tensorboard": False, "eval_fraction": 0.1}
    return SFTConfig(**{**base, **kw})


def test_the_tokens_trained_are_what_a_rollout_produces(tiny_tokenizer):
    """Every assistant turn is its text's canonical tokens plus the end-of-turn token, the
    rest is the template's rendering, and the whole equals the template's full rendering of
    the conversation (no drift); the loss mask is 1 exactly on the assistant turns."""
    from agentrl.envs.template import ChatTemplateBridge

    bridge = ChatTemplateBridge(tiny_tokenizer)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say <|im_end|> twice"},
                {"role": "assistant", "content": "<|im_end|> <|im_end|>"},
                {"role": "user", "content": "Now once."},
                {"role": "assistant", "content": "one"}]
    traj = chat_trajectory(bridge, messages)
    assert bridge.check_drift(messages, traj.token_ids, turn=2, open_turn=False) is None
    assert len(traj.turns) == 2
    for turn, m in zip(traj.turns, (messages[2], messages[4]), strict=True):
        assert traj.token_ids[turn.start:turn.end] == bridge.action_ids(m["content"])
    special = {i for i, t in tiny_tokenizer.added_tokens_decoder.items() if t.special}
    first = traj.turns[0]
    # The content spelling a special token is text, not the token itself.
    assert not special & set(traj.token_ids[first.start:first.end - 1])
    trained = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    assert trained == [t for turn in traj.turns for t in traj.token_ids[turn.start:turn.end]]


@pytest.mark.slow
def test_sft_lowers_the_held_out_loss_and_exports_a_model(tmp_path):
    cfg = _cfg(tmp_path, dataset=str(_chats(tmp_path / "chats.jsonl")), epochs=4,
               batch_size=16, eval_every=4)
    summary = run_sft(cfg)
    assert summary["eval_examples"] > 0 and summary["train_examples"] > 80
    assert summary["eval_after"]["eval/loss"] < 0.75 * summary["eval_before"]["eval/loss"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == summary["steps"] and losses[-1] < losses[0]
    from agentrl.models import load_model

    exported = load_model(summary["hf_model"])
    trained = load_model("tiny")
    assert not torch.equal(exported.lm_head.weight, trained.lm_head.weight)


def test_trajectories_train_on_their_recorded_tokens_filtered_by_reward(tmp_path,
                                                                        tiny_tokenizer):
    rng = random.Random(0)
    trajs = []
    for i in range(12):
        b = TrajectoryBuilder(group=f"g{i}")
        b.add_observation([rng.randrange(4, 300) for _ in range(5)])
        b.add_action([rng.randrange(4, 300) for _ in range(3)], [-1.0] * 3)
        traj = b.build(terminated=True, truncated=False)
        traj.turns[0].reward = float(i % 2)
        trajs.append(traj)
    save_jsonl(trajs[:6], tmp_path / "rollouts" / "step_000001.jsonl")
    save_jsonl(trajs[6:], tmp_path / "rollouts" / "step_000002.jsonl")
    cfg = _cfg(tmp_path, trajectories=str(tmp_path / "rollouts"), min_reward=1.0,
               eval_fraction=0.0)
    data = load_sft_data(cfg, tiny_tokenizer)
    assert data.skipped == 6 and sorted(t.token_ids for t in data.train) == sorted(
        t.token_ids for t in trajs if t.total_reward >= 1)
    trainer = SFTTrainer(cfg, data, tiny_tokenizer)
    batch = trainer.batch(data.train)
    for row, t in enumerate(data.train):
        n = len(t.token_ids)
        assert batch.input_ids[row, :n].tolist() == t.token_ids
        assert batch.mask[row, : n - 1].tolist() == [float(m) for m in t.loss_mask[1:]]
    with pytest.raises(ValueError, match="none reaches --min_reward 5"):
        load_sft_data(_cfg(tmp_path, trajectories=str(tmp_path / "rollouts"), min_reward=5.0),
                      tiny_tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("qlora", [False, True], ids=["full", "qlora"])
def test_resume_continues_exactly(tmp_path, qlora):
    """Also QLoRA's: its checkpoints hold the packed 4-bit base with bitsandbytes' packing
    state beside it, which loads back onto the run's own base."""
    from trainers.config import ActorConfig

    actor = (ActorConfig(model="tiny", lr=1e-2, lora_rank=4, lora_alpha=8, load_in_4bit=True)
             if qlora else ActorConfig(model="tiny", lr=1e-3))
    data = str(_chats(tmp_path / "chats.jsonl", n=60))
    whole = _cfg(tmp_path, dataset=data, max_steps=4, batch_size=8, run_dir=str(tmp_path / "a"),
                 actor=actor)
    run_sft(whole)
    half = _cfg(tmp_path, dataset=data, max_steps=2, batch_size=8, run_dir=str(tmp_path / "b"),
                actor=actor)
    run_sft(half)
    resumed = _cfg(tmp_path, dataset=data, max_steps=4, batch_size=8,
                   run_dir=str(tmp_path / "b"), resume="auto", actor=actor)
    run_sft(resumed)

    def losses(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().split("\n")
                if x]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    assert losses("a") == pytest.approx(losses("b"), rel=1e-6, abs=0)
    from agentrl.models import load_model

    a, b = load_model(str(tmp_path / "a" / "hf")), load_model(str(tmp_path / "b" / "hf"))
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0, msg=name)


def test_bad_data_is_reported_before_any_model_loads(tmp_path, monkeypatch, capsys):
    from agentrl import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model was loaded"))
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                              "content": "hello"}]}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(good) + "\n{not json\n" + json.dumps({"text": "x"}) + "\n")
    run = str(tmp_path / "run")
    assert main(["sft", "--dataset", str(bad), "--actor.model", "tiny", "--run_dir", run]) == 2
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err
    lacking = tmp_path / "lacking.jsonl"
    lacking.write_text(json.dumps({"text": "x"}) + "\n")
    assert main(["sft", "--dataset", str(lacking), "--actor.model", "tiny",
                 "--run_dir", run]) == 2
    assert "lacking.jsonl:1: no 'messages' key" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["sft", "--dataset", str(empty), "--actor.model", "tiny", "--run_dir", run]) == 2
    assert "has no usable rows" in capsys.readouterr().err
    assert main(["sft", "--actor.model", "tiny"]) == 2
    assert "give --dataset" in capsys.readouterr().err
    # Skipping instead of stopping: the bad lines are counted, the good one kept.
    from agentrl.models import load_tokenizer
    from trainers.config import ActorConfig

    cfg = SFTConfig(dataset=str(bad), bad_rows="skip", eval_fraction=0.0,
                    actor=ActorConfig(model="tiny"))
    data = load_sft_data(cfg, load_tokenizer("tiny"))
    assert (len(data.train), data.skipped) == (1, 2)
