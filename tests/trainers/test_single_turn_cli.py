"""Single-turn RL from the command line (#18 item 5): `agentrl train --dataset data.jsonl
--reward_fn rewards.py:score` builds the one-step env with no Python glue."""

from __future__ import annotations

import json

import pytest

from agentrl.trajectory_files import load_jsonl
from trainers.cli import build_config, main

ROWS = [{"question": f"What is {a}+{b}? Answer with a number.", "answer": str(a + b)}
        for a, b in ((2, 3), (1, 1), (3, 4), (2, 2))]
FAST = ["--actor.model", "tiny", "--use_ray", "false", "--progress", "false",
        "--tensorboard", "false", "--rollout.prompts_per_step", "2",
        "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "8"]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "rewards.py").write_text(
        "def score(prompt, response, label):\n"
        "    return {'reward': float(label in response), 'said': response[:20]}\n")
    (tmp_path / "openrlhf.py").write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    return [float(l in q[len(p):]) for q, p, l in zip(queries, prompts, labels)]\n")
    return tmp_path


@pytest.mark.parametrize("reward", ["rewards.py:score", "openrlhf.py"])
def test_a_dataset_and_a_reward_file_train_with_no_glue(files, reward, capsys):
    run = files / "run"
    argv = ["--dataset", str(files / "data.jsonl"), "--reward_fn", str(files / reward),
            "--dataset.prompt_key", "question", "--dataset.label_key", "answer",
            "--steps", "2", "--run_dir", str(run), *FAST]
    assert main(argv) == 0, capsys.readouterr().err
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["env"] == "single-turn" and cfg["dataset"]["prompt_key"] == "question"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1, 2]
    trajs = load_jsonl(run / "rollouts" / "step_000001.jsonl")
    assert len(trajs) == 4 and all(len(t.turns) == 1 for t in trajs)  # one step each
    from agentrl.models import load_tokenizer

    tok = load_tokenizer("tiny")
    for t in trajs:  # the row's question, templated; the reward is the function's
        row = ROWS[t.info["index"]]
        assert row["question"] in tok.decode(t.token_ids[:t.turns[0].start])
        assert "<|im_start|>user" in tok.decode(t.token_ids[:t.turns[0].start])
        response = tok.decode(t.token_ids[t.turns[0].start:t.turns[0].end],
                              skip_special_tokens=True)
        assert t.total_reward == float(row["answer"] in response)


BAD = [
    (["--reward_fn", "{dir}/rewards.py:score"], "needs both --dataset"),
    (["--dataset", "{dir}/data.jsonl"], "needs both --dataset"),
    (["--dataset", "{dir}/nope.jsonl", "--reward_fn", "{dir}/rewards.py:score"],
     "does not exist"),
    (["--dataset", "{dir}/data.jsonl", "--reward_fn", "{dir}/rewards.py:score"],
     (r"data.jsonl:1: no 'prompt' key \(it has \['answer', 'question'\]\); name the column "
      r"with --dataset.prompt_key")),
    (["--dataset", "{dir}/data.jsonl", "--dataset.prompt_key", "question", "--reward_fn",
      "{dir}/rewards.py:nope"], "'nope'"),
    (["--dataset", "{dir}/data.jsonl", "--dataset.prompt_key", "question", "--reward_fn",
      "{dir}/rewards.py"], "must define reward_func"),
    (["--env", "digits", "--dataset", "{dir}/data.jsonl", "--reward_fn",
      "{dir}/rewards.py:score"], "drop --env"),
]


@pytest.mark.parametrize(("argv", "says"), BAD, ids=[b[1][:20] for b in BAD])
def test_bad_single_turn_flags_fail_before_loading(files, argv, says):
    argv = [a.format(dir=files) for a in argv]
    with pytest.raises(ValueError, match=says):
        build_config(argv)
