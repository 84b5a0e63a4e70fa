"""`agentrl dpo`: pairs tokenized as a rollout's replies, reference log-likelihoods from the
initial (or a given) model, the implicit reward margin rising on held-out pairs, bad pairs
reported."""

from __future__ import annotations

import json

import pytest
import torch

from agentrl.cli import main
from tests.trainers._preference_pairs import pair_config
from trainers.dpo import DPOConfig, DPOTrainer, load_pairs, run_dpo


def _cfg(tmp_path, **kw):
    return pair_config(DPOConfig, tmp_path, **kw)


def _reply_logprob(model, traj) -> float:
    """Plain reference: sum of log softmax of the reply's tokens given everything before."""
    turn = traj.turns[0]
    with torch.no_grad():
        logits = model(torch.tensor([traj.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return sum(float(logp[t - 1, traj.token_ids[t]]) for t in range(turn.start, turn.end))


def test_pairs_and_reference_logprobs(tmp_path, tiny_tokenizer):
    from agentrl.envs.template import ChatTemplateBridge
    from agentrl.models import load_model

    cfg = _cfg(tmp_path)
    data = load_pairs(cfg, tiny_tokenizer)
    bridge = ChatTemplateBridge(tiny_tokenizer)
    row = json.loads((tmp_path / "pairs.jsonl").read_text().splitlines()[0])
    first = next(p for p in data.train + data.eval
                 if p.chosen.token_ids[p.chosen.turns[0].start:] == bridge.action_ids(
                     row["chosen"]))
    prompt = bridge.prompt_ids([{"role": "user", "content": row["prompt"]}])
    for traj, text in ((first.chosen, row["chosen"]), (first.rejected, row["rejected"])):
        assert traj.token_ids == prompt + bridge.action_ids(text)
        assert traj.loss_mask == [0] * len(prompt) + [1] * (len(traj.token_ids) - len(prompt))
    trainer = DPOTrainer(cfg, data, tiny_tokenizer)
    model = load_model("tiny")
    for p in data.train[:3] + data.eval[:2]:
        assert p.ref_chosen == pytest.approx(_reply_logprob(model, p.chosen), abs=1e-4)
        assert p.ref_rejected == pytest.approx(_reply_logprob(model, p.rejected), abs=1e-4)
    # Before any update the policy is the reference: every pair's DPO loss is log 2.
    assert trainer.evaluate()["loss"] == pytest.approx(0.6931, abs=1e-4)
    # Another reference model gives that model's log-likelihoods.
    other = load_model("tiny")
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.05 * torch.randn_like(param))
    other.save_pretrained(tmp_path / "ref")
    tiny_tokenizer.save_pretrained(tmp_path / "ref")
    data2 = load_pairs(cfg, tiny_tokenizer)
    DPOTrainer(_cfg(tmp_path, ref_model=str(tmp_path / "ref")), data2, tiny_tokenizer)
    p = data2.train[0]
    assert p.ref_chosen == pytest.approx(_reply_logprob(other, p.chosen), abs=1e-4)
    assert abs(p.ref_chosen - _reply_logprob(model, p.chosen)) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_the_held_out_reward_margin_rises(tmp_path, loss):
    extra = {"beta": 0.5} if loss == "ipo" else {"label_smoothing": 0.1}
    summary = run_dpo(_cfg(tmp_path, loss=loss, epochs=3, **extra))
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["eval/rewards/margin"] == pytest.approx(0.0, abs=1e-5)
    assert after["eval/rewards/margin"] > 0.1
    assert after["eval/rewards/accuracy"] > 0.6
    assert after["eval/loss"] < before["eval/loss"]


def test_bad_pairs_are_reported_before_any_model_loads(tmp_path, monkeypatch, capsys):
    from agentrl import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model was loaded"))
    same = tmp_path / "same.jsonl"
    same.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n"
                    + json.dumps({"prompt": "p", "chosen": "a", "rejected": "a"}) + "\n")
    run = str(tmp_path / "run")
    assert main(["dpo", "--dataset", str(same), "--actor.model", "tiny", "--run_dir", run]) == 2
    assert "same.jsonl:2: chosen and rejected are the same reply" in capsys.readouterr().err
    lacking = tmp_path / "lacking.jsonl"
    lacking.write_text(json.dumps({"question": "p", "chosen": "a", "rejected": "b"}) + "\n")
    assert main(["dpo", "--dataset", str(lacking), "--actor.model", "tiny",
                 "--run_dir", run]) == 2
    err = capsys.readouterr().err
    assert "lacking.jsonl:1: no 'prompt' key" in err and "--prompt_key" in err
    assert main(["dpo", "--dataset", str(same), "--loss", "ipo", "--label_smoothing", "0.1"]) == 2
    assert "--loss ipo takes none" in capsys.readouterr().err
