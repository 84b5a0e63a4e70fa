"""GridWalk: moves, the border, holes, truncation, per-step rewards, its state key and scripted
policy, and GiGPO finding recurring states in a group walked through the token bridge."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import agentrl  # noqa: F401 - registers the toy env ids
from agentrl.anchors import recurring_states
from agentrl.completion import SamplingParams
from agentrl.engine.fakes import FakeEngine
from agentrl.rollout import collect_sync
from agentrl.types import dense_group_ids
from environments.toy.grid import GridWalkEnv

# layout 0 on 4x4:    ....
#                     ....
#                     .O.O
#                     ...G


def _env(**kwargs: object) -> GridWalkEnv:
    env = GridWalkEnv(**kwargs)  # type: ignore[arg-type]
    env.np_random = np.random.default_rng(0)
    return env


def _at(env: GridWalkEnv, cell: tuple[int, int]) -> None:
    env.reset()
    env.cell, env.start_distance = cell, env.distance[cell]


def test_layout_and_prompt() -> None:
    env = _env()
    messages, info = env.reset()
    assert env.holes == {(2, 1), (2, 3)}
    assert "....\n....\n.O.O\n...G" in messages[0]["content"]
    r, c = env.cell
    assert messages[0]["content"].endswith(f"You are at row {r}, column {c}.")
    assert info["state_key"] == f"{r},{c}" and env.distance[env.cell] >= 2


def test_moves_border_and_unparsable_answers_keep_or_change_the_cell() -> None:
    env = _env()
    _at(env, (0, 0))
    new, reward, done, truncated, info = env.step("Right")
    assert env.cell == (0, 1) and info["state_key"] == "0,1" and reward == 0.0
    assert new[0]["content"] == "You are at row 0, column 1." and not (done or truncated)
    new, *_ = env.step("up")  # the border: stays
    assert env.cell == (0, 1) and new[0]["content"].startswith("That is the edge of the grid.")
    new, *_ = env.step("??")
    assert env.cell == (0, 1) and new[0]["content"].startswith("Answer with U, D, L or R.")
    env.step("move down")  # the first of U/D/L/R in either case: "d"
    assert env.cell == (1, 1)


def test_goal_hole_and_truncation_end_episodes() -> None:
    env = _env(max_moves=3)
    _at(env, (3, 1))
    assert env.step("R")[1:3] == (0.0, False)
    new, reward, done, _, _ = env.step("R")
    assert (new, reward, done) == ([], 1.0, True)
    _at(env, (1, 1))
    new, reward, done, _, info = env.step("D")
    assert (new, reward, done, info["state_key"]) == ([], 0.0, True, "2,1")
    _at(env, (0, 0))
    assert [env.step("L")[3] for _ in range(3)] == [False, False, True]


def test_progress_rewards_sum_to_the_outcome() -> None:
    env = _env(progress_reward=1.0)
    _at(env, (0, 2))  # distance 4
    rewards = [env.step(m)[1] for m in "DDL"]  # 4 -> 3 -> 2 (2,2); L to (2,1) is a hole
    assert rewards[:2] == [0.25, 0.25] and sum(rewards) == pytest.approx(0.0)
    _at(env, (0, 2))
    rewards = [env.step(m)[1] for m in "LDR"]  # away (5), then 4 ... not the goal
    assert rewards == [-0.25, 0.25, 0.25]
    rewards += [env.step(m)[1] for m in "DDR"]  # (1,2) -> (2,2) -> (3,2) -> goal
    assert sum(rewards) == pytest.approx(1.0)


def test_the_scripted_policy_walks_a_shortest_path_from_every_cell() -> None:
    env = _env(max_moves=16)
    for cell, distance in env.distance.items():
        if distance == 0:
            continue
        _at(env, cell)
        for moves in range(1, distance + 1):
            _, reward, done, _, _ = env.step(env.oracle_action())
            assert done == (moves == distance)
        assert reward == 1.0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="size >= 2"):
        GridWalkEnv(size=1)
    with pytest.raises(ValueError, match="holes"):
        GridWalkEnv(size=2, holes=3)


def test_episodes_of_a_group_walk_recurring_states(tiny_tokenizer) -> None:
    """Through the token bridge, the collector records each turn's cell; a group's episodes
    share their cells, so GiGPO has anchor states past the first step."""
    engine = FakeEngine(tiny_tokenizer, reply="U")
    trajs = collect_sync(
        engine, lambda: gym.make("agentrl/GridWalk-v0", tokenizer=tiny_tokenizer, max_moves=4),
        num_prompts=2, n_samples_per_prompt=2, sampling=SamplingParams(max_tokens=4),
        seeds=[1, 4])  # starts (1, 1) and (2, 0)
    for traj in trajs:
        r, c = map(int, traj.turns[0].state_key.split(","))
        assert [t.state_key for t in traj.turns] == [f"{max(r - k, 0)},{c}" for k in range(4)]
        assert traj.rewards == [0.0] * 4 and traj.truncated
    assert recurring_states(trajs, dense_group_ids(trajs)) >= 2
