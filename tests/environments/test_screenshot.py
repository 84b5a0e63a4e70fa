"""The built-in screenshot environments: oracle and image-blind play, malformed actions,
held-out splits, determinism, and what the policy sees through the chat bridge."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import agentrl  # registers the ids
from agentrl.models import load_tokenizer
from environments.screenshot.actions import Click, Submit, Type, parse_action
from environments.screenshot.click import ScreenClickEnv
from environments.screenshot.form import ScreenFormEnv


def _play(env, policy, seed):
    env.np_random = np.random.default_rng(seed)
    msgs, info = env.reset(seed=seed)
    total, seen = 0.0, [msgs]
    while True:
        new, r, term, trunc, info = env.step(policy(env))
        total += r
        seen.append(new)
        if term or trunc:
            return total, info, seen


def test_parse_action():
    assert parse_action("I will click(12, 40) now") == Click(12, 40)
    assert parse_action('type("MAYA")') == Type("MAYA")
    assert parse_action("submit()") == Submit()
    assert parse_action("click the button") is None


def test_click_oracle_wins_and_blind_play_stays_at_the_ceiling():
    env = ScreenClickEnv(split="eval")
    assert all(_play(env, lambda e: e.oracle_action(), s)[0] == pytest.approx(1.0)
               for s in range(20))
    # Blind: the best a policy that cannot see can do is one fixed cell.
    blind = np.mean([_play(env, lambda e: "click(42, 42)", s)[0] for s in range(600)])
    assert env.blind_ceiling == 1 / 16
    assert abs(blind - env.blind_ceiling) < 0.03 and blind <= 0.25


def test_click_target_is_drawn_where_the_oracle_clicks():
    env = ScreenClickEnv()
    env.np_random = np.random.default_rng(0)
    env.reset(seed=0)
    x, y = map(int, env.oracle_action()[6:-1].split(","))
    img = env.render()
    assert tuple(img[y, x]) == (220, 30, 30)
    assert img.shape == env.image_shape


def test_click_malformed_action_gets_feedback():
    env = ScreenClickEnv()
    env.np_random = np.random.default_rng(1)
    env.reset(seed=1)
    new, r, term, trunc, info = env.step("I don't know")
    assert r == 0 and not term and not trunc and info["malformed"]
    assert "not an action" in new[0]["content"][0]["text"]


@pytest.mark.parametrize("cls", [ScreenClickEnv, ScreenFormEnv])
def test_splits_are_disjoint(cls):
    def episodes(split):
        env = cls(split=split)
        env.np_random = np.random.default_rng(0)
        out = set()
        for s in range(300):
            env.reset(seed=s)
            out.add(tuple(env.sequence) if cls is ScreenClickEnv else tuple(env.values.items()))
        return out

    train, held_out = episodes("train"), episodes("eval")
    assert train and held_out and not train & held_out


def test_form_oracle_fills_and_submits():
    env = ScreenFormEnv(split="eval")
    for s in range(10):
        total, info, seen = _play(env, lambda e: e.oracle_action(), s)
        assert total == 1.0 and info["success"] == 1.0
        # The values are only on the screen: no message text carries them.
        texts = [p["text"] for msgs in seen for m in msgs for p in m["content"]
                 if p["type"] == "text"]
        assert not any(v in t for v in env.values.values() for t in texts)


def test_form_shows_what_was_typed_and_wrong_values_fail():
    env = ScreenFormEnv()
    env.np_random = np.random.default_rng(2)
    env.reset(seed=2)
    before = env.render()
    env.step("click(144, 54)")  # the name field
    env.step('type("XYZ")')
    after = env.render()
    assert env.typed["name"] == "XYZ" and not np.array_equal(before, after)
    _, r, term, trunc, info = env.step("submit()")
    assert term and not trunc and r == 0.0 and info["success"] == 0.0


def test_form_type_without_focus_and_malformed():
    env = ScreenFormEnv(max_steps=3)
    env.np_random = np.random.default_rng(3)
    env.reset(seed=3)
    new, *_ = env.step('type("A")')
    assert "click a field first" in new[0]["content"][0]["text"]
    new, _, _, _, info = env.step("hello")
    assert info["malformed"]
    _, r, term, trunc, _ = env.step("hello")
    assert trunc and not term and r == 0.0  # out of steps


@pytest.mark.parametrize("env_id", ["agentrl/ScreenClick-v0", "agentrl/ScreenForm-v0"])
def test_registered_and_seen_through_a_vision_model(env_id):
    tok = load_tokenizer("tiny-qwen2-vl")
    env = gym.make(env_id, tokenizer=tok)
    obs, _ = env.reset(seed=0)
    assert len(obs["images"]) == 1
    assert obs["images"][0] in env.observation_space["images"].feature_space
    vision = env.unwrapped.bridge._vision
    assert sum(t == vision.image_token_id for t in obs["tokens"]) == vision.encode(
        obs["images"][0]).num_tokens
    assert env_id.split("/")[1] in [e.id.split("/")[1] for e in agentrl.list_envs()]


def test_screenshots_need_a_vision_model():
    """Refused when made, in one line naming the fix (not in Jinja at the first reset)."""
    from agentrl.models.vision import ImageError

    with pytest.raises(ImageError, match=r"^ScreenClickEnv shows images, but tokenizer 'tiny' "
                       r"belongs to a text-only model; pass tokenizer='embedded-vlm'"):
        gym.make("agentrl/ScreenClick-v0", tokenizer="tiny")
