"""Key-value lookup, a task for tool-using agents (#32 item 1): every task has its own random
store of five keys with four-digit values, and asks for the value of one key. The store is
shown only through the task's tools, so an answer is right only when the agent called a tool
with the right key and read what came back; nothing about formatting is scored.

    train.jsonl   256 tasks over 80 key words
    eval.jsonl    128 held-out tasks over 40 other key words (none of the training keys)

A task is one JSON object: `question` (what the model is asked), `store` (for the agent's
tools, never for the model), `key`, `answer` and `label` (the answer, for a reward service).
The tools' behaviour is defined here once (`lookup`, `list_keys`) so that agents written with
different frameworks (examples/agents/) give the model the same observations; `reward` scores
an agent's final answer. `python -m environments.kv_lookup` writes the two files again (they
are what `make_tasks` gives; tests/environments/test_kv_lookup.py checks that).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

KEYS = (
    "amber", "apple", "arrow", "badge", "basin", "beacon", "berry", "blade", "bloom", "bottle",
    "branch", "bridge", "brook", "cabin", "candle", "canyon", "carpet", "castle", "cedar", "chalk",
    "cherry", "cliff", "cloud", "comet", "coral", "cotton", "crane", "crown", "daisy", "delta",
    "desert", "dove", "dragon", "eagle", "ember", "falcon", "feather", "fern", "field", "flame",
    "forest", "fossil", "garden", "glacier", "grape", "harbor", "hazel", "helmet", "island",
    "ivory", "jacket", "jungle", "kettle", "lantern", "lemon", "lily", "marble", "meadow",
    "mirror", "monkey", "mountain", "needle", "oasis", "ocean", "olive", "orchid", "otter",
    "panda", "parrot", "pebble", "pepper", "pillow", "planet", "pocket", "quartz", "rabbit",
    "raven", "ribbon", "river", "rocket", "saddle", "salmon", "satin", "shadow", "shell", "silver",
    "sparrow", "spider", "spring", "stone", "storm", "summit", "tiger", "timber", "topaz", "tower",
    "tulip", "valley", "velvet", "violet", "walnut", "whale", "willow", "window", "winter",
    "wizard", "anchor", "bamboo", "biscuit", "button", "cactus", "compass", "copper", "dolphin",
    "engine", "fiddle", "goblet", "hammer", "igloo", "jasmine",
)
"""120 words for keys."""
TRAIN_KEYS, EVAL_KEYS = KEYS[::3] + KEYS[1::3], KEYS[2::3]  # 80 and 40, disjoint

STORE_SIZE = 5
QUESTIONS = (
    "What value is stored under the key '{key}'?",
    "Look up the key '{key}' and tell me its value.",
    "What is the value of '{key}' in the store?",
    "I need the value for the key '{key}'. What is it?",
    "Find the value of the key '{key}'.",
)
SPLITS = {"train": (256, 0, TRAIN_KEYS), "eval": (128, 1, EVAL_KEYS)}
"""split -> (number of tasks, generator seed, the key words it draws from)."""

AGENT_INSTRUCTIONS = (
    "You answer questions about a private key-value store. You cannot know its values: call "
    "the lookup tool with the key, then answer with the value it returns, in one short "
    "sentence: The value of KEY is VALUE."
)
"""What an agent for this task tells the model (both example agents in examples/agents/)."""
AGENT_MAX_TURNS = 4
"""Model calls per episode: enough to list the keys, look one up and answer."""
AGENT_MAX_TOKENS = 48
"""Tokens per model call: a tool call or a short answer."""


def make_tasks(split: str) -> list[dict[str, Any]]:
    """The tasks of `split` ("train" or "eval"), the same on every machine."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    n, seed, words = SPLITS[split]
    rng = np.random.default_rng(seed)
    tasks = []
    for i in range(n):
        keys = [str(k) for k in rng.choice(words, STORE_SIZE, replace=False)]
        values = [str(v) for v in rng.choice(np.arange(1000, 10000), STORE_SIZE, replace=False)]
        at = int(rng.integers(STORE_SIZE))
        question = QUESTIONS[int(rng.integers(len(QUESTIONS)))].format(key=keys[at])
        tasks.append({"id": f"kv-{split}-{i}", "question": question,
                      "store": dict(zip(keys, values, strict=True)), "key": keys[at],
                      "answer": values[at], "label": values[at]})
    return tasks


def task_file(split: str) -> str:
    """The path of `split`'s JSON-lines file (for --agent_tasks / --agent_eval_tasks)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    return str(Path(__file__).with_name(f"{split}.jsonl"))


def lookup(store: dict[str, str], key: str) -> str:
    """The `lookup(key)` tool: a sentence giving the value under `key`, or an error naming the
    keys there are."""
    key = str(key).strip().strip("'\"")
    if key in store:
        return f"The value of {key!r} is {store[key]}."
    return f"Error: no key {key!r} in the store. Keys: {', '.join(store)}."


def list_keys(store: dict[str, str]) -> str:
    """The `list_keys()` tool: the store's keys."""
    return ", ".join(store)


def reward(task: dict[str, Any], result: object) -> float:
    """1.0 when the agent's final answer holds the task's value as a number of its own (not
    inside a longer one), else 0.0."""
    answer = str(task["answer"])
    return float(re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", str(result or "")) is not None)


def write_task_files() -> None:
    for split in SPLITS:
        rows = "".join(json.dumps(t) + "\n" for t in make_tasks(split))
        Path(task_file(split)).write_text(rows)
