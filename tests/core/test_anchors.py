"""GiGPO's anchor states (agentrl/anchors.py): env keys over observations, images in the
observation hash, what recurs, and the collector recording GuessNumber's keys."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

import agentrl  # noqa: F401 - registers the toy env ids
from agentrl.anchors import names_states, recurring_states, state_ids, state_visits
from agentrl.completion import SamplingParams
from agentrl.engine.fakes import FakeEngine
from agentrl.rollout import collect_sync
from agentrl.types import Image, Trajectory, TrajectoryBuilder, Turn


def _episode(observations: list[list[int]], keys: list[str | None] | None = None,
             **info: object) -> Trajectory:
    b = TrajectoryBuilder(group="g")
    for k, obs in enumerate(observations):
        b.add_observation(obs)
        b.add_action([90 + k], [-1.0]).state_key = keys[k] if keys else None
    return b.build(terminated=True, truncated=False, info=dict(info))


def test_env_key_wins_and_equal_observations_are_equal_states() -> None:
    a = _episode([[1, 2], [5], [6]])
    b = _episode([[1, 2], [5], [7]])
    ia, ib = state_ids(a), state_ids(b)
    assert ia[:2] == ib[:2] and ia[2] != ib[2]
    assert all(i != 0 and 0 < i < 2**63 for i in ia + ib)
    # Keys name states whatever the observation shows; a key never equals an observation.
    keyed = _episode([[1, 2], [5], [6]], keys=["start", "room", "room"])
    ik = state_ids(keyed)
    assert ik[1] == ik[2] and ik[0] != ia[0]
    assert names_states([keyed]) and not names_states([a, b])


def test_images_are_part_of_the_observed_state() -> None:
    def shot(value: int) -> Trajectory:
        traj = _episode([[1], [3, 3, 3]])
        traj.images.append(Image(pixels=np.full((2, 2, 3), value, np.uint8), start=3, end=6))
        return traj

    assert state_ids(shot(0))[1] != state_ids(shot(1))[1]  # same tokens, other screenshot
    assert state_ids(shot(0)) == state_ids(shot(0))


def test_state_key_round_trips_and_is_left_out_when_none() -> None:
    turn = Turn(obs_start=0, start=2, end=3, state_key="3-7")
    assert Turn.from_dict(turn.to_dict()) == turn
    assert "state_key" not in Turn(obs_start=0, start=2, end=3).to_dict()


def test_recurring_states_skip_first_turns_and_count_per_group() -> None:
    # The prompt is shared by construction and is not an anchor.
    assert recurring_states([_episode([[1], [5]]), _episode([[1], [6]])], [0, 0]) == 0
    trajs = [_episode([[1], [5], [8]]), _episode([[1], [6], [5]]), _episode([[1], [5]])]
    assert recurring_states(trajs, [0, 0, 0]) == 1
    assert recurring_states(trajs, [0, 1, 2]) == 0  # the same state in other groups
    ids = [state_ids(t) for t in trajs]
    assert state_visits(trajs, [0, 0, 0]) == {(0, ids[0][1]): 3, (0, ids[0][2]): 1,
                                              (0, ids[1][1]): 1}
    # A later segment's first turn is a step of its episode like any other.
    later = _episode([[4], [9]], segment=1)
    assert recurring_states([_episode([[1], [4]]), later], [0, 0]) == 1


def test_the_collector_records_guess_numbers_state_keys(tiny_tokenizer) -> None:
    engine = FakeEngine(tiny_tokenizer, reply="8")
    trajs = collect_sync(
        engine, lambda: gym.make("agentrl/GuessNumber-v0", tokenizer=tiny_tokenizer,
                                 max_guesses=3, progress_reward=1.0),
        num_prompts=16, sampling=SamplingParams(max_tokens=4), seeds=list(range(16)))
    for t in trajs:
        secret = t.info["secret"]
        keys = [turn.state_key for turn in t.turns]
        if secret == 8:
            assert keys == ["1-16"] and t.rewards == [1.0]
            continue
        after = "9-16" if secret > 8 else "1-7"
        assert keys == ["1-16", after, after]
        # 8 of 16 numbers (or 7 of 16 with 9-16 left) ruled out, then nothing new.
        assert t.rewards == [(16 - (8 if secret > 8 else 7)) / 16, 0.0, 0.0]
    assert {t.info["secret"] > 8 for t in trajs if t.info["secret"] != 8} == {True, False}
