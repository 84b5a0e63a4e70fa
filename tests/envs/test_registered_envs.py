"""Every registered env: `gym.make(id)` alone builds it or says what to pass (#34 item 12),
gymnasium's checker, same-seed determinism, pickling."""

from __future__ import annotations

import pickle

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import agentrl
from agentrl.envs.registry import env_factory
from tests.browsers import browser_unavailable

# agentrl's own ids (the library's and the built-in catalog's), not the ones tests register.
IDS = [e.id for e in agentrl.list_envs() if e.id.startswith("agentrl/")]


def _shows_images(env_id):
    return bool(getattr(env_factory(env_id), "shows_images", False))


_SINGLE_TURN = {"dataset": [{"prompt": "2+2?", "label": "4"}, {"prompt": "1+2?", "label": "3"}]}


def _single_turn_files(d):
    """A dataset file and a reward function file, what SingleTurn-v0's error asks for."""
    import json

    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _SINGLE_TURN["dataset"]))
    (d / "rewards.py").write_text(
        "def score(prompt, response, label):\n    return float(label in response)\n")
    return {"dataset": str(d / "data.jsonl"), "reward_fn": f"{d / 'rewards.py'}:score"}


NEEDS = {"agentrl/SingleTurn-v0": _single_turn_files}
"""The envs that cannot be built without arguments, and what their error says to pass."""

BROWSER_ENVS = {"agentrl/MiniWoB-v0"}
"""The envs that drive a real Chromium: skipped, saying why, where it is not installed."""


def _skip_without_browser(env_id):
    if env_id in BROWSER_ENVS and (unavailable := browser_unavailable()) is not None:
        pytest.skip(f"no browser here: {unavailable}")


def _make(env_id, tok):
    _skip_without_browser(env_id)
    kwargs = {}
    if _shows_images(env_id):  # screenshots need a vision-language model
        from agentrl.models import load_tokenizer

        tok = load_tokenizer("tiny-qwen2-vl")
    if env_id in NEEDS:
        import tempfile
        from pathlib import Path

        kwargs = NEEDS[env_id](Path(tempfile.mkdtemp(prefix="agentrl-env-args-")))
    try:
        return gym.make(env_id, tokenizer=tok, **kwargs)
    except ModuleNotFoundError as e:  # an env whose module is not in this checkout
        pytest.fail(f"{env_id} is registered but its module is missing: {e}")


@pytest.mark.embedded
@pytest.mark.parametrize("env_id", [
    # An image env's default, the embedded VLM, is built on first use (about a minute, then
    # cached under $AGENTRL_CACHE).
    pytest.param(i, marks=[pytest.mark.slow] if _shows_images(i) else []) for i in IDS])
def test_gym_make_alone_builds_or_says_what_to_pass(env_id, tmp_path):
    _skip_without_browser(env_id)
    try:
        env = gym.make(env_id)
    except TypeError as e:
        message = str(e)
        assert env_id in NEEDS, f"gym.make({env_id!r}) failed: {message}"
        assert "\n" not in message and "Traceback" not in message
        assert message.startswith(f"{env_id} needs dataset= and reward_fn=, which were not given; "
                                  f"e.g. gym.make({env_id!r}, dataset='data.jsonl', ")
        env = gym.make(env_id, **NEEDS[env_id](tmp_path))
    else:
        assert env_id not in NEEDS
    tokenizer = env.unwrapped.tokenizer
    # An env that shows images defaults to the embedded VLM, the others to the embedded model.
    want = "embedded-vlm" if _shows_images(env_id) else "smollm2-135m-instruct"
    assert want in tokenizer.name_or_path
    check_env(env.unwrapped, skip_render_check=True)
    env.close()


@pytest.mark.parametrize("env_id", [i for i in IDS if _shows_images(i)])
def test_an_image_env_refuses_a_text_only_tokenizer_when_made(env_id, tiny_tokenizer):
    with pytest.raises(ValueError, match=r"^Screen\w+Env shows images, but tokenizer 'tiny' "
                       r"belongs to a text-only model; pass tokenizer='embedded-vlm' \(the "
                       r"default, built in\) or a vision-language model's name or directory"):
        gym.make(env_id, tokenizer=tiny_tokenizer)


def test_a_chat_env_that_declares_images_needs_a_model_that_sees(tiny_tokenizer):
    """The declaration is the env's (`shows_images`), not the catalog's: any chat env."""

    class Photo(agentrl.ChatEnv):
        shows_images = True

        def reset(self, *, seed=None, options=None):
            image = np.zeros((8, 8, 3), dtype=np.uint8)
            return [{"role": "user", "content": [{"type": "image", "image": image}]}]

    with pytest.raises(ValueError, match="^Photo shows images, but tokenizer 'tiny'"):
        agentrl.ChatTokenEnv(Photo(), tiny_tokenizer)
    env = agentrl.ChatTokenEnv(Photo(), "tiny-qwen2-vl")
    obs, _ = env.reset(seed=0)
    assert len(obs["images"]) == 1


def test_missing_constructor_arguments_are_named_with_an_example():
    class NeedsRows(agentrl.ChatEnv):
        def __init__(self, rows, *, scale=1.0):
            self.rows = rows

    agentrl.register("agentrl-test/NeedsRows-v0", NeedsRows)
    with pytest.raises(TypeError, match=r"^agentrl-test/NeedsRows-v0 needs rows=, which was not "
                       r"given; e.g. gym.make\('agentrl-test/NeedsRows-v0', rows=\.\.\.\)"):
        gym.make("agentrl-test/NeedsRows-v0")


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
    try:
        env.reset(seed=3)
        clone = pickle.loads(pickle.dumps(env))
        try:
            action = np.asarray(tiny_tokenizer.encode("12", add_special_tokens=False),
                                dtype=np.int64)
            a = env.step(action)
            b = clone.step(action)
            assert a[0]["tokens"].tolist() == b[0]["tokens"].tolist()
            assert a[1:4] == b[1:4]
        finally:
            clone.close()  # MiniWoB's copy holds a browser of its own
    finally:
        env.close()


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
