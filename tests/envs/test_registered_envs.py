"""Every registered env: gymnasium's checker, same-seed determinism, pickling."""

from __future__ import annotations

import pickle

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import agentrl

# math-tir needs the sandbox and is covered by tests/environments; the rest are cheap.
IDS = [e.id for e in agentrl.list_envs() if e.id.startswith("agentrl/")]


_SINGLE_TURN = {"dataset": [{"prompt": "2+2?", "label": "4"}, {"prompt": "1+2?", "label": "3"}]}


def _make(env_id, tok):
    kwargs = {}
    if env_id.startswith("agentrl/Screen"):  # screenshots need a vision-language model
        from agentrl.models import load_tokenizer

        tok = load_tokenizer("tiny-qwen2-vl")
    if env_id == "agentrl/SingleTurn-v0":  # a dataset file and a reward function file
        import json
        import tempfile
        from pathlib import Path

        d = Path(tempfile.mkdtemp(prefix="agentrl-single-turn-"))
        (d / "data.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in _SINGLE_TURN["dataset"]))
        (d / "rewards.py").write_text(
            "def score(prompt, response, label):\n    return float(label in response)\n")
        kwargs = {"dataset": str(d / "data.jsonl"), "reward_fn": f"{d / 'rewards.py'}:score"}
    try:
        return gym.make(env_id, tokenizer=tok, **kwargs)
    except ModuleNotFoundError as e:  # an env whose module is not in this checkout
        pytest.fail(f"{env_id} is registered but its module is missing: {e}")


@pytest.mark.parametrize("env_id", IDS)
def test_check_env(env_id, tiny_tokenizer):
    env = _make(env_id, tiny_tokenizer)
    check_env(env.unwrapped, skip_render_check=True)
    env.close()


@pytest.mark.parametrize("env_id", IDS)
def test_same_seed_same_episode(env_id, tiny_tokenizer):
    def run(seed):
        env = _make(env_id, tiny_tokenizer)
        obs, _ = env.reset(seed=seed)
        tokens = [obs["tokens"].tolist()]
        rng = np.random.default_rng(0)
        for _ in range(3):
            action = rng.integers(0, env.unwrapped.vocab_size, size=5)
            obs, r, term, trunc, _ = env.step(action)
            tokens.append((obs["tokens"].tolist(), r))
            if term or trunc:
                break
        env.close()
        return tokens

    assert run(7) == run(7)


@pytest.mark.parametrize("env_id", IDS)
def test_pickle_roundtrip_mid_episode(env_id, tiny_tokenizer):
    env = _make(env_id, tiny_tokenizer)
    obs, _ = env.reset(seed=3)
    clone = pickle.loads(pickle.dumps(env))
    action = np.asarray(tiny_tokenizer.encode("12", add_special_tokens=False), dtype=np.int64)
    a = env.step(action)
    b = clone.step(action)
    assert a[0]["tokens"].tolist() == b[0]["tokens"].tolist()
    assert a[1:4] == b[1:4]


def test_agentrl_colon_id_imports_package():
    # gym.make("agentrl:agentrl/X-v0") imports agentrl itself; run it in a fresh interpreter.
    import subprocess
    import sys

    code = (
        "import gymnasium as gym, sys\n"
        "env = gym.make('agentrl:agentrl/Reverse-v0', tokenizer='tiny')\n"
        "obs, _ = env.reset(seed=0)\n"
        "print(len(obs['tokens']) > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_unknown_id_says_did_you_mean():
    with pytest.raises(gym.error.NameNotFound, match="Did you mean"):
        gym.make("agentrl/Revers-v0")


def test_import_is_light():
    import subprocess
    import sys

    code = (
        "import sys, agentrl\n"
        "heavy = [m for m in ('torch', 'transformers', 'ray', 'fastapi') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
