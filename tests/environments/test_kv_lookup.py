"""The key-value lookup tasks of the agent headline (#32 item 1): shipped files, a real
hold-out, tools and reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from environments.kv_lookup import (
    EVAL_KEYS,
    TRAIN_KEYS,
    list_keys,
    lookup,
    make_tasks,
    reward,
    task_file,
)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_the_shipped_files_are_what_the_generator_gives(split):
    rows = [json.loads(line) for line in Path(task_file(split)).read_text().splitlines()]
    assert rows == make_tasks(split)
    assert len(rows) == {"train": 256, "eval": 128}[split]


def test_held_out_tasks_share_no_key_and_no_store_with_training():
    train, held_out = make_tasks("train"), make_tasks("eval")
    assert not set(TRAIN_KEYS) & set(EVAL_KEYS)
    assert not {k for t in train for k in t["store"]} & {k for t in held_out for k in t["store"]}
    for t in train + held_out:
        # The answer is in the store under the asked key, and the question shows the key
        # but no value: only a tool call can find it.
        assert t["store"][t["key"]] == t["answer"] == t["label"]
        assert t["key"] in t["question"]
        assert not any(v in t["question"] for v in t["store"].values())
        assert len(set(t["store"].values())) == len(t["store"]) == 5


def test_tools_and_reward():
    store = {"river": "4821", "stone": "1093"}
    assert lookup(store, "river") == "The value of 'river' is 4821."
    # Quoted as in the question: still found.
    assert lookup(store, " 'stone' ") == "The value of 'stone' is 1093."
    assert lookup(store, "lake") == "Error: no key 'lake' in the store. Keys: river, stone."
    assert list_keys(store) == "river, stone"
    task = {"answer": "4821"}
    assert reward(task, "The value stored under 'river' is 4821.") == 1.0
    assert reward(task, "48210") == 0.0 and reward(task, "14821") == 0.0  # not inside a number
    assert reward(task, "I cannot know.") == 0.0 and reward(task, None) == 0.0
    with pytest.raises(ValueError, match="split must be one of"):
        make_tasks("test")
