"""The merge rule, on the Session object directly and through chat templates."""

from __future__ import annotations

import numpy as np
import pytest

from agentrl.completion import Completion
from agentrl.types import Image
from servers.sessions import CallRecord, Session


def _call(cid: str, prompt: list[int], *actions: list[int], retry: int = 0,
          aborted: bool = False, images: list[Image] | None = None) -> CallRecord:
    choices = [Completion(token_ids=a, logprobs=[-0.5] * len(a), finish_reason="stop")
               for a in actions]
    return CallRecord(call_id=cid, prompt_ids=prompt, choices=choices, aborted=aborted,
                      retry_count=retry, images=images or [])


def test_extending_calls_merge_into_one_trajectory():
    s = Session("s")
    s.record(_call("a", [1, 2, 3], [10, 11]))
    s.record(_call("b", [1, 2, 3, 10, 11, 4, 5], [12]))
    (traj,) = s.trajectories()
    assert traj.token_ids == [1, 2, 3, 10, 11, 4, 5, 12]
    assert traj.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert traj.logprobs == [0, 0, 0, -0.5, -0.5, 0, 0, -0.5]
    assert [(t.obs_start, t.start, t.end) for t in traj.turns] == [(0, 3, 5), (5, 7, 8)]
    assert s.drift_events == 0
    traj.validate()


def test_non_extending_call_starts_segment_and_counts_drift():
    s = Session("s")
    s.record(_call("a", [1, 2, 3], [10, 11]))
    s.record(_call("b", [1, 2, 3, 10, 99, 4], [12]))  # history re-tokenized differently
    t0, t1 = s.trajectories()
    assert t0.token_ids == [1, 2, 3, 10, 11]
    assert t1.token_ids == [1, 2, 3, 10, 99, 4, 12]
    assert (t0.info["drift"], t1.info["drift"]) == (False, True)
    assert s.drift_events == 1
    assert s.summary()["drift_events"] == 1


def test_prompt_equal_to_running_ids_extends_with_empty_observation():
    s = Session("s")
    s.record(_call("a", [1, 2], [3]))
    s.record(_call("b", [1, 2, 3], [4]))
    (traj,) = s.trajectories()
    assert traj.turns[1].obs_start == traj.turns[1].start == 3


def test_n_choices_fork_and_later_call_extends_the_chosen_one():
    s = Session("s")
    s.record(_call("a", [1, 2], [10], [20], [30]))
    s.record(_call("b", [1, 2, 20, 5], [21]))  # the client continued choice 1
    trajs = s.trajectories()
    assert sorted(t.token_ids for t in trajs) == [[1, 2, 10], [1, 2, 20, 5, 21], [1, 2, 30]]
    assert s.drift_events == 0
    assert next(t for t in trajs if len(t.turns) == 2).info["choices"] == [1, 0]


def test_retry_replaces_the_failed_attempt():
    s = Session("s")
    s.record(_call("a", [1, 2], [10]))
    s.record(_call("b", [1, 2, 10, 3], [11]))
    s.record(_call("c", [1, 2, 10, 3], [12], retry=1))
    (traj,) = s.trajectories()
    assert traj.token_ids == [1, 2, 10, 3, 12]
    assert s.summary()["replaced_calls"] == 1
    assert s.drift_events == 0


def test_retry_without_earlier_attempt_is_just_recorded():
    s = Session("s")
    s.record(_call("a", [1, 2], [10], retry=2))
    assert s.trajectories()[0].token_ids == [1, 2, 10]


def test_aborted_calls_are_kept_but_not_merged():
    s = Session("s")
    s.record(_call("a", [1, 2], [10]))
    s.record(_call("b", [1, 2, 10, 3], [4, 5], aborted=True))
    s.record(_call("c", [1, 2, 10, 3], [6]))
    (traj,) = s.trajectories()
    assert traj.token_ids == [1, 2, 10, 3, 6]
    assert s.summary()["aborted_calls"] == 1


def test_rewards_attach_to_last_call_or_named_call():
    s = Session("s")
    s.record(_call("a", [1], [2]))
    s.record(_call("b", [1, 2, 3], [4]))
    s.add_reward(1.0)
    s.add_reward(0.25, call_id="a")
    (traj,) = s.trajectories()
    assert traj.rewards == [0.25, 1.0]
    assert traj.terminated
    with pytest.raises(KeyError, match="no call 'zzz'"):
        s.add_reward(1.0, call_id="zzz")


def test_reward_on_empty_session_is_refused():
    with pytest.raises(KeyError, match="no completed call"):
        Session("s").add_reward(1.0)


def test_a_reward_or_a_sum_of_rewards_that_is_not_finite_is_refused_unrecorded():
    """#34 item 1: checked before anything changes, so it never reaches a store's journal."""
    s = Session("s")
    s.record(_call("a", [1], [2], [3]))
    journal: list[tuple[str, object]] = []
    s.journal = lambda kind, payload: journal.append((kind, payload))
    for bad in (float("nan"), float("inf"), -float("inf"), 10**400):
        with pytest.raises(ValueError, match=r"a reward must be a finite number .* got"):
            s.add_reward(bad)
    s.add_reward(1e308, call_id="a", choice=0)
    with pytest.raises(ValueError, match="past the float range"):
        s.add_reward(1e308, call_id="a", choice=1)  # another turn, but the session's total
    with pytest.raises(ValueError, match=r"sizes \(\|reward\|\) must add up to less"):
        s.add_reward(-1e308, call_id="a")  # sums finite here, but the bound is on the sizes
    assert [r.value for r in s.rewards] == [1e308] and len(journal) == 1
    assert s.summary()["reward"] == 1e308
    assert [t.rewards for t in s.trajectories()] == [[1e308], [0.0]]


def test_images_are_placed_once_in_the_trajectory():
    px = np.zeros((2, 2, 3), dtype=np.uint8)
    s = Session("s")
    s.record(_call("a", [1, 7, 7, 2], [10], images=[Image(pixels=px, start=1, end=3)]))
    s.record(_call("b", [1, 7, 7, 2, 10, 7, 7, 3], [11],
                   images=[Image(pixels=px, start=1, end=3), Image(pixels=px, start=5, end=7)]))
    (traj,) = s.trajectories()
    assert [(im.start, im.end) for im in traj.images] == [(1, 3), (5, 7)]


def test_trajectories_round_trip_json():
    from agentrl.types import Trajectory

    s = Session("s", group="g")
    s.record(_call("a", [1, 2], [3, 4]))
    (traj,) = s.trajectories()
    back = Trajectory.from_json(traj.to_json())
    assert back.token_ids == traj.token_ids and back.group == "g"
