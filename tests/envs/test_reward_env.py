from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import agentrl
from agentrl.envs import ChatTokenEnv
from agentrl.rewards import RewardEnv, RewardFunctionError, load_reward_func

DATA = [{"prompt": "What is 2+2?", "label": "4"}, {"prompt": "What is 3+3?", "label": "6"}]


def exact(prompt, response, label):
    return float(response.strip() == label)


def _answer(env, tok, text):
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return env.step(np.asarray(ids))


def test_one_step_scores_and_terminates(tiny_tokenizer):
    env = ChatTokenEnv(RewardEnv(DATA, exact, system_prompt="Answer briefly."), tiny_tokenizer)
    obs, info = env.reset(options={"index": 1})
    assert info["index"] == 1
    assert "What is 3+3?" in tiny_tokenizer.decode(obs["tokens"])
    obs, r, term, trunc, info = _answer(env, tiny_tokenizer, "6")
    assert (r, term, trunc, len(obs["tokens"])) == (1.0, True, False, 0)
    env.reset(options={"index": 0})
    assert _answer(env, tiny_tokenizer, "5")[1] == 0.0


def test_dict_reward_extras_go_to_info(tiny_tokenizer):
    env = ChatTokenEnv(
        RewardEnv(DATA, lambda prompt, response, label: {"reward": 0.5, "format_ok": True}),
        tiny_tokenizer,
    )
    env.reset(seed=0)
    _, r, _, _, info = _answer(env, tiny_tokenizer, "x")
    assert r == 0.5 and info["format_ok"] is True


def test_raising_reward_fn_names_function_and_sample(tiny_tokenizer):
    def broken(prompt, response, label):
        raise ZeroDivisionError("oops")

    env = ChatTokenEnv(RewardEnv(DATA, broken), tiny_tokenizer)
    env.reset(options={"index": 1})
    with pytest.raises(
        RewardFunctionError, match=r"'test_raising.*broken' on sample 1 .*3\+3.*ZeroDivisionError"
    ):
        _answer(env, tiny_tokenizer, "6")


def test_non_number_reward_is_rejected(tiny_tokenizer):
    env = ChatTokenEnv(RewardEnv(DATA, lambda prompt, response, label: "yes"), tiny_tokenizer)
    env.reset(options={"index": 0})
    with pytest.raises(RewardFunctionError, match="returned 'yes'.*expected a float"):
        _answer(env, tiny_tokenizer, "4")


def test_dataset_errors():
    with pytest.raises(ValueError, match="row 1 has no 'prompt' key"):
        RewardEnv([{"prompt": "a"}, {"question": "b"}], exact)
    with pytest.raises(ValueError, match="non-empty"):
        RewardEnv([], exact)


def test_openrlhf_reward_file(tmp_path, tiny_tokenizer):
    path = tmp_path / "reward.py"
    path.write_text(
        "import torch\n"
        "def reward_func(queries, prompts, labels):\n"
        "    rs = [float(q[len(p):].strip() == l) for q, p, l in zip(queries, prompts, labels)]\n"
        "    return {'rewards': torch.tensor(rs), 'scores': torch.tensor(rs), 'extra_logs': {}}\n"
    )
    fn = load_reward_func(path)
    env = ChatTokenEnv(RewardEnv(DATA, fn), tiny_tokenizer)
    env.reset(options={"index": 0})
    assert _answer(env, tiny_tokenizer, "4")[1] == 1.0
    with pytest.raises(ValueError, match="does not exist"):
        load_reward_func(tmp_path / "missing.py")


def test_registered_reward_env_via_gym_make(tiny_tokenizer, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "Say 4", "label": "4"}\n')
    agentrl.register("test/Say-v0", RewardEnv, dataset=str(data), reward_fn=exact)
    env = gym.make("test/Say-v0", tokenizer=tiny_tokenizer)
    env.reset(seed=0)
    assert _answer(env, tiny_tokenizer, "4")[1] == 1.0
