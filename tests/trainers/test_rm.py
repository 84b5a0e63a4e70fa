"""`agentrl rm`: a Bradley-Terry reward model whose held-out pairwise accuracy rises well above
chance, saved so that it loads back with the same scores."""

from __future__ import annotations

import json

import pytest
import torch

from agentrl.cli import main
from agentrl.models.value import load_reward_model
from tests.trainers._preference_pairs import WORDS, pair_config, write_pairs
from trainers.rm import RMConfig, run_rm


def _cfg(tmp_path, **kw):
    return pair_config(RMConfig, tmp_path, columns={"margin": 1.0}, **kw)


@pytest.mark.slow
# A margin of 1 between unseen replies is the harder target: after 4 epochs its held-out
# accuracy ranged 0.42-0.83 over seeds 0-3, after 10 epochs 0.79-0.96.
@pytest.mark.parametrize("kw", [{}, {"loss": "logexp"}, {"margin_key": "margin", "epochs": 10}],
                         ids=["sigmoid", "logexp", "margin"])
def test_held_out_pairwise_accuracy_rises_and_the_model_loads_back(tmp_path, kw):
    summary = run_rm(_cfg(tmp_path, **{"epochs": 4, **kw}))
    assert summary["eval_before"]["eval/reward/accuracy"] == 0.5  # a zero head: every pair ties
    assert summary["eval_after"]["eval/reward/accuracy"] >= 0.7
    if "margin_key" not in kw:  # a margin of 1 between unseen replies is the harder target
        assert summary["eval_after"]["eval/loss"] < summary["eval_before"]["eval/loss"]
    rm = load_reward_model(summary["reward_model"])
    from agentrl.envs.template import ChatTemplateBridge
    from agentrl.models import load_tokenizer

    bridge = ChatTemplateBridge(load_tokenizer(summary["reward_model"]))
    prompt = bridge.prompt_ids([{"role": "user", "content": "Repeat: apple river"}])
    good, bad = (prompt + bridge.action_ids(t) for t in ("apple river", "stone cloud"))
    with torch.no_grad():
        scores = [float(rm(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                           at=torch.tensor([len(ids) - 1]))) for ids in (good, bad)]
    assert scores[0] > scores[1]


def test_bad_settings_and_files(tmp_path, capsys):
    pairs = str(write_pairs(tmp_path / "pairs.jsonl", n=4, margin=1.0))
    assert main(["rm", "--dataset", pairs, "--loss", "logexp", "--margin_key", "margin"]) == 2
    assert "--loss logexp takes no margin" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a reward model saved by `agentrl rm`"):
        load_reward_model(tmp_path)


@pytest.mark.slow
@pytest.mark.ray
def test_a_reward_model_scores_single_turn_rl_in_its_own_actor_and_starts_the_critic(tmp_path,
                                                                                    capsys):
    """#18 item 2: `--reward.model DIR` scores the episodes (in a Ray actor, in batches) and
    `--algo.critic_init DIR` starts PPO's critic from the same reward model."""
    from agentrl.rewards.model import RewardModelScorer
    from agentrl.trajectory_files import load_jsonl
    from trainers.cli import main as train

    summary = run_rm(_cfg(tmp_path, max_steps=3))
    rm_dir = summary["reward_model"]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Repeat: {w}"}) + "\n" for w in WORDS[:4]))
    run = tmp_path / "rl"
    argv = ["--dataset", str(data), "--reward.model", rm_dir, "--algo.estimator", "gae",
            "--algo.critic_init", rm_dir, "--actor.model", "tiny", "--steps", "1",
            "--rollout.prompts_per_step", "2", "--rollout.n_samples_per_prompt", "2",
            "--rollout.max_new_tokens", "6", "--run_dir", str(run), "--progress", "false",
            "--tensorboard", "false"]
    assert train(argv) == 0
    trajs = load_jsonl(run / "rollouts" / "step_000001.jsonl")
    scorer = RewardModelScorer(rm_dir, "cpu")
    from agentrl.models import load_tokenizer

    tok = load_tokenizer("tiny")
    items = []
    for t in trajs:
        turn = t.turns[0]
        ids = t.token_ids[turn.start:turn.end]
        text = tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids,
                          skip_special_tokens=False)
        items.append({"prompt": f"Repeat: {WORDS[t.info['index']]}", "response": text})
    want = scorer.score(items)
    assert [t.total_reward for t in trajs] == pytest.approx(want, abs=1e-4)
    assert len(set(want)) > 1  # real scores, not a constant
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("value_loss" in r for r in rows)
    for bad, says in ((["--reward.model", str(tmp_path)], "not a reward model"),
                      (["--algo.critic_init", rm_dir], "needs --algo.estimator gae")):
        assert train(["--dataset", str(data), "--reward.model", rm_dir, *bad,
                      "--actor.model", "tiny"]) == 2
        assert says in capsys.readouterr().err
