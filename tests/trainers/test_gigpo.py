"""--algo.estimator gigpo in the trainer: state ids in the batch, the step's advantages, the
warning when nothing recurs, the flags, and math-tir (final reward only, tool outputs that
differ) where GiGPO is GRPO exactly; rtg_turn's turn ends from the same batch."""

from __future__ import annotations

import itertools
import logging
import re

import gymnasium as gym
import pytest
import torch

import agentrl  # noqa: F401 - registers the env ids
from agentrl import algorithms as A
from agentrl.anchors import state_ids
from agentrl.completion import SamplingParams
from agentrl.engine.fakes import FakeEngine
from agentrl.rollout import collect_sync
from agentrl.types import Trajectory, dense_group_ids
from trainers import rl_step
from trainers.batch import collate
from trainers.config import AlgoConfig, RolloutConfig, TrainConfig


def _guesses(tok, plans: list[list[int]]) -> list[Trajectory]:
    """GuessNumber's seeds 3 and 5 (secrets 13 and 11), len(plans) episodes each: an episode
    takes the next plan and guesses its numbers in turn (tagged with its plan's letter)."""
    counter = itertools.count()

    def reply(prompt: str, _choice: int) -> str:
        earlier = re.findall(r"assistant\n\d+ ([a-z])<\|im_end\|>", prompt)
        i = "abcdefgh".index(earlier[0]) if earlier else next(counter) % len(plans)
        return f"{plans[i][len(earlier)]} {'abcdefgh'[i]}"

    return collect_sync(
        FakeEngine(tok, reply=reply),
        lambda: gym.make("agentrl/GuessNumber-v0", tokenizer=tok, max_guesses=3,
                         progress_reward=1.0),
        num_prompts=2, n_samples_per_prompt=len(plans), sampling=SamplingParams(max_tokens=4),
        seeds=[3, 5])


# From 1-16, every plan's first guess 8 leaves 9-16 (both secrets are above 8): an anchor state
# whose second guesses rule out more (12, 10) or less (16, 9) of it.
PLANS = [[8, 12, 10], [8, 16, 15], [8, 10, 12], [8, 9, 9]]


def test_the_batch_carries_each_turns_state_on_its_last_policy_target(tiny_tokenizer):
    trajs = _guesses(tiny_tokenizer, PLANS)
    batch = collate(trajs, pad_id=0)
    assert batch.state_ids is not None and batch.state_ids.dtype == torch.long
    for b, traj in enumerate(trajs):
        marked = batch.state_ids[b].nonzero().flatten().tolist()
        assert marked == [turn.end - 2 for turn in traj.turns]
        assert batch.state_ids[b, marked].tolist() == state_ids(traj)
        assert bool((batch.mask[b, marked] == 1).all())


def test_the_step_adds_the_step_level_where_states_recur(tiny_tokenizer):
    trajs = _guesses(tiny_tokenizer, PLANS)
    groups = dense_group_ids(trajs)
    assert rl_step.check_anchor_states(trajs, groups) > 0
    batch = collate(trajs, pad_id=0, group_ids=groups)
    gigpo, _ = rl_step.batch_advantages(AlgoConfig(estimator="gigpo"), batch, None, 0.0)
    direct, _ = A.compute_advantages(
        "gigpo", rewards_BT=batch.rewards, mask_BT=batch.mask, group_ids_B=batch.group_ids,
        state_ids_BT=batch.state_ids, step_gamma=0.95, step_weight=1.0)
    torch.testing.assert_close(gigpo, direct)
    grpo, _ = rl_step.batch_advantages(AlgoConfig(estimator="group_norm"), batch, None, 0.0)
    assert not torch.equal(gigpo, grpo)
    # omega = 0 is GRPO.
    flat, _ = rl_step.batch_advantages(AlgoConfig(estimator="gigpo", step_weight=0.0), batch,
                                       None, 0.0)
    assert torch.equal(flat, grpo)


def test_rtg_turn_gets_each_turns_end_from_the_batch(tiny_tokenizer):
    """--algo.estimator rtg_turn: the trainer hands it the batch's turn ends (its state ids);
    each turn is compared with the same turn of the group, so it differs from the outcome
    advantage (GuessNumber's per-guess rewards differ between turns)."""
    trajs = _guesses(tiny_tokenizer, PLANS)
    batch = collate(trajs, pad_id=0, group_ids=dense_group_ids(trajs))
    rtg, ret = rl_step.batch_advantages(AlgoConfig(estimator="rtg_turn"), batch, None, 0.0)
    direct, _ = A.compute_advantages(
        "rtg_turn", rewards_BT=batch.rewards, mask_BT=batch.mask, group_ids_B=batch.group_ids,
        state_ids_BT=batch.state_ids)
    torch.testing.assert_close(rtg, direct)
    torch.testing.assert_close(ret, rtg)
    grpo, _ = rl_step.batch_advantages(AlgoConfig(estimator="group_norm"), batch, None, 0.0)
    assert not torch.allclose(rtg, grpo)
    assert bool((rtg[batch.mask == 0] == 0).all())


def test_no_state_key_and_nothing_recurring_warns_once(monkeypatch, caplog):
    from agentrl.types import TrajectoryBuilder

    def episode(obs: list[int]) -> Trajectory:
        b = TrajectoryBuilder(group="g")
        b.add_observation([1, 2])
        b.add_action([9], [-1.0])
        b.add_observation(obs)
        b.add_action([9], [-1.0]).reward = float(obs[0])
        return b.build(terminated=True, truncated=False)

    monkeypatch.setattr(rl_step, "_WARNED", set())
    lone = [episode([1]), episode([0])]
    with caplog.at_level(logging.WARNING, logger="trainers.rl_step"):
        _, _, metrics = rl_step.training_batch(lone, AlgoConfig(estimator="gigpo"),
                                               max_new_tokens=8)
        rl_step.training_batch(lone, AlgoConfig(estimator="gigpo"), max_new_tokens=8)
    assert metrics["anchor_states"] == 0.0
    warned = [r for r in caplog.records if "gigpo is plain GRPO" in r.getMessage()]
    assert len(warned) == 1 and "info['state_key']" in warned[0].getMessage()
    # Recurring observations: no warning, and the count says so.
    monkeypatch.setattr(rl_step, "_WARNED", set())
    caplog.clear()
    _, _, metrics = rl_step.training_batch([episode([1]), episode([1])],
                                           AlgoConfig(estimator="gigpo"), max_new_tokens=8)
    assert metrics["anchor_states"] == 1.0 and not caplog.records


def test_gigpo_flags_are_checked():
    with pytest.raises(ValueError, match="--algo.step_gamma in \\(0, 1\\]"):
        AlgoConfig(estimator="gigpo", step_gamma=0.0)
    with pytest.raises(ValueError, match="--algo.step_weight must be >= 0"):
        AlgoConfig(estimator="gigpo", step_weight=-1.0)
    with pytest.raises(ValueError, match="--algo.estimator gigpo needs a group"):
        TrainConfig(algo=AlgoConfig(estimator="gigpo"),
                    rollout=RolloutConfig(n_samples_per_prompt=1))


@pytest.fixture
def sandbox():
    from agentrl.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError

    try:
        return Sandbox(SandboxConfig(timeout_s=5.0, memory_mb=256))
    except SandboxUnavailableError as e:
        pytest.skip(f"sandbox isolation unavailable here: {e}")


def test_on_math_tir_gigpo_is_grpo_exactly(tiny_tokenizer, sandbox):
    """Final reward only; each episode runs code printing its own number, then answers (right
    in every other episode): no state recurs past the prompt, and every advantage is GRPO's."""
    env = gym.make("agentrl/MathTIR-v0", tokenizer=tiny_tokenizer, split="eval", num_problems=8)
    golds = {}
    for i in range(8):
        env.reset(options={"index": i})
        problem = env.unwrapped.chat_env.problem
        golds[problem.question] = problem.answer
    env.close()
    counter = itertools.count()

    def reply(prompt: str, _choice: int) -> str:
        question = next(q for q in golds if q in prompt)  # after the prompt's worked example
        episode = prompt[prompt.index(question):]
        if "Output:" not in episode:
            return f"Let me compute.\n```python\nprint({next(counter)})\n```"
        gold = golds[question]
        said = re.findall(r"Output: (\d+)", episode)[-1]
        return f"So \\boxed{{{gold if int(said) % 2 else 'nope'}}}."

    trajs = collect_sync(
        FakeEngine(tiny_tokenizer, reply=reply),
        lambda: gym.make("agentrl/MathTIR-v0", tokenizer=tiny_tokenizer, split="eval",
                         num_problems=8),
        num_prompts=2, n_samples_per_prompt=4, sampling=SamplingParams(max_tokens=64),
        seeds=[0, 1])
    assert all(len(t.turns) == 2 and t.rewards[0] == 0.0 for t in trajs)
    assert len({t.total_reward for t in trajs}) == 2  # right and wrong answers
    groups = dense_group_ids(trajs)
    assert rl_step.check_anchor_states(trajs, groups) == 0
    batch = collate(trajs, pad_id=0, group_ids=groups)
    gigpo = rl_step.batch_advantages(AlgoConfig(estimator="gigpo"), batch, None, 0.0)
    grpo = rl_step.batch_advantages(AlgoConfig(estimator="group_norm"), batch, None, 0.0)
    assert bool(grpo[0].ne(0).any())
    for x, y in zip(gigpo, grpo, strict=True):
        assert torch.equal(x, y)
