"""Problem data: reasoning-gym generation, file loading, splits, and bad input."""

from __future__ import annotations

import json
import logging

import pytest

from environments.math_tir.data import (
    generate_problems,
    load_problems,
    problem_uid,
    split_of,
)
from environments.math_tir.env import MathEnv


@pytest.mark.parametrize(
    ("tasks", "difficulty"),
    [
        ("basic_arithmetic", "easy"),
        ("gsm_symbolic", "easy"),
        ({"basic_arithmetic": 2, "chain_sum": 1, "lcm": 1}, "medium"),
    ],
)
def test_train_and_eval_splits_are_disjoint(tasks, difficulty):
    train = generate_problems(tasks, split="train", num_problems=1500, difficulty=difficulty)
    evals = generate_problems(tasks, split="eval", num_problems=150, difficulty=difficulty)
    assert len(train) == 1500 and len(evals) == 150
    assert not {p.uid for p in train} & {p.uid for p in evals}
    assert not {" ".join(p.question.split()) for p in train} & {
        " ".join(p.question.split()) for p in evals
    }
    assert len({p.uid for p in train}) == len(train)  # no duplicate questions within a split
    # A different generation seed draws other problems but never crosses the split.
    other = generate_problems(tasks, split="train", num_problems=300, difficulty=difficulty, seed=1)
    assert not {p.uid for p in other} & {p.uid for p in evals}


def test_generation_is_deterministic_and_prefix_stable():
    a = generate_problems("basic_arithmetic", split="eval", num_problems=32, seed=3)
    b = generate_problems("basic_arithmetic", split="eval", num_problems=64, seed=3)
    assert a == b[:32]
    assert a != generate_problems("basic_arithmetic", split="eval", num_problems=32, seed=4)


def test_difficulty_changes_problems():
    easy = generate_problems("basic_arithmetic", split="eval", num_problems=50)
    hard = generate_problems("basic_arithmetic", split="eval", num_problems=50, difficulty="hard")
    assert max(len(p.question) for p in easy) < max(len(p.question) for p in hard)


def test_a_difficulty_mix_holds_both_kinds_in_its_shares():
    """#20: the default run trains on "easy,medium" ({"easy": w, "medium": w} weighs them); each
    share is what that difficulty alone generates, and the split stays disjoint."""
    easy = set(generate_problems("basic_arithmetic", split="train", num_problems=200))
    medium = set(generate_problems("basic_arithmetic", split="train", num_problems=600,
                                   difficulty="medium"))
    mix = generate_problems("basic_arithmetic", split="train", num_problems=400,
                            difficulty="easy,medium")
    assert len(mix) == len(set(mix)) == 400
    assert sum(p in easy for p in mix) == 200 and sum(p in medium for p in mix) == 200
    weighted = generate_problems("basic_arithmetic", split="train", num_problems=400,
                                 difficulty={"easy": 1, "medium": 3})
    assert sum(p in medium for p in weighted) == 300
    evals = generate_problems("basic_arithmetic", split="eval", num_problems=40,
                              difficulty="easy,medium")
    assert not {p.uid for p in evals} & {p.uid for p in mix}
    with pytest.raises(ValueError, match=r"difficulty must be one of .* got 'meduim'"):
        generate_problems("basic_arithmetic", difficulty="easy,meduim")
    with pytest.raises(ValueError, match="difficulty weight for 'easy' must be a positive"):
        generate_problems("basic_arithmetic", difficulty={"easy": 0})


def test_unknown_task_and_split_say_what_to_do():
    with pytest.raises(
        ValueError, match="unknown reasoning-gym task 'gsm_symbolc'.*'gsm_symbolic'"
    ):
        generate_problems("gsm_symbolc")
    with pytest.raises(ValueError, match="split must be one of.*Did you mean 'eval'"):
        generate_problems("gsm_symbolic", split="test")
    with pytest.raises(ValueError, match="difficulty must be one of"):
        generate_problems("gsm_symbolic", difficulty="extreme")


def test_file_missing_key_names_file_row_and_key(write_jsonl):
    path = write_jsonl([{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "anwser": "4"}])
    with pytest.raises(
        ValueError,
        match=rf"{path.name}:2: missing key 'answer'"
        r"\. Did you mean 'anwser'",
    ):
        load_problems(path)


@pytest.mark.parametrize(
    ("row", "key", "got"),
    [
        ({"question": 5, "answer": "5"}, "question", "int"),
        ({"question": "q?", "answer": [1, 2]}, "answer", "list"),
        ({"question": "q?", "answer": True}, "answer", "bool"),
    ],
)
def test_file_wrong_type_names_file_row_and_key(write_jsonl, row, key, got):
    path = write_jsonl([{"question": "ok?", "answer": 1}, {"question": "fine?", "answer": 2}, row])
    with pytest.raises(
        ValueError,
        match=rf"{path.name}:3: key '{key}' must be "
        rf".*got {got}",
    ):
        load_problems(path)


def test_custom_keys_and_numeric_answers(write_jsonl):
    rows = [{"problem": f"What is {i} + {i}?", "solution": 2 * i} for i in range(200)]
    path = write_jsonl(rows)
    train = load_problems(path, question_key="problem", answer_key="solution")
    evals = load_problems(path, split="eval", question_key="problem", answer_key="solution")
    assert len(train) + len(evals) == 200 and evals
    assert not {p.uid for p in train} & {p.uid for p in evals}
    assert all(split_of(problem_uid(p.question)) == "eval" for p in evals)
    with pytest.raises(ValueError, match="missing key 'question'.*question_key="):
        load_problems(path)


def test_unparseable_answers_are_skipped_with_a_warning(write_jsonl, caplog):
    rows = [{"question": f"Q{i}?", "answer": str(i)} for i in range(60)]
    rows += [{"question": f"Bad{i}?", "answer": ""} for i in range(5)]
    rows += [{"question": "Odd?", "answer": "\\frac{"}]
    with caplog.at_level(logging.WARNING):
        problems = load_problems(write_jsonl(rows))
    assert all(p.answer not in ("", "\\frac{") for p in problems)
    assert "skipped" in caplog.text and "cannot parse" in caplog.text
    n_bad = sum(split_of(problem_uid(r["question"])) == "train" for r in rows[60:])
    assert f"skipped {n_bad} of" in caplog.text


def test_parquet_and_datasets_dir(tmp_path):
    import datasets

    rows = {
        "question": [f"What is {i} * 3?" for i in range(50)],
        "answer": [str(3 * i) for i in range(50)],
    }
    ds = datasets.Dataset.from_dict(rows)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    a = load_problems(tmp_path / "p.parquet")
    b = load_problems(tmp_path / "saved")
    assert [p.uid for p in a] == [p.uid for p in b] and len(a) > 30
    env = MathEnv(data_path=str(tmp_path / "p.parquet"))
    assert env.reset(options={"index": 0})[0][-1]["content"] == a[0].question


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_problems(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match="unknown dataset format '.csv'"):
        load_problems(tmp_path / "x.csv")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "a", "answer": "1"}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_problems(tmp_path / "bad.jsonl")


def test_envs_built_in_many_threads_at_once_find_their_tasks():
    """The first math envs of a process are built by the rollout's thread pool all at once: the
    one importing reasoning-gym registers its tasks while the others look them up. Each must
    wait for the whole registry (they once saw half of it: "unknown reasoning-gym task
    'basic_arithmetic'"). A fresh interpreter, so reasoning-gym is not imported yet."""
    import subprocess
    import sys

    code = """
from concurrent.futures import ThreadPoolExecutor
from environments.math_tir.data import generate_problems
errors = []
def make(i):
    try:
        generate_problems("basic_arithmetic", split="eval", num_problems=20,
                          difficulty="easy,medium")
    except ValueError as e:
        errors.append(e)
with ThreadPoolExecutor(64) as pool:
    list(pool.map(make, range(64)))
print(len(errors))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.split()[-1] == "0", out.stdout + out.stderr
