"""Reward shaping and dynamic filtering against loops and hand examples."""

from __future__ import annotations

import statistics

import pytest
import torch

from agentrl.algorithms import dynamic_filter, overlong_penalty, truncation_penalty


def test_overlong_penalty_matches_reference_and_hand_example() -> None:
    lengths = torch.randint(0, 130, (64,))
    rewards = torch.randn(64)
    got = overlong_penalty(rewards, lengths, max_new_tokens=128, buffer=32, factor=1.5)
    want = []
    for r, n in zip(rewards.tolist(), lengths.tolist()):
        exceed = n - (128 - 32)
        want.append(r - min(exceed, 32) / 32 * 1.5 if exceed > 0 else r)
    torch.testing.assert_close(got, torch.tensor(want))
    hand = overlong_penalty(torch.ones(4), torch.tensor([96, 104, 128, 200]),
                            max_new_tokens=128, buffer=32, factor=1.0)
    torch.testing.assert_close(hand, torch.tensor([1.0, 0.75, 0.0, 0.0]))


def test_truncation_penalty_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.5, -0.5, 2.0])
    truncated = torch.tensor([True, True, True, False])
    torch.testing.assert_close(truncation_penalty(rewards, truncated, 0.5),
                               torch.tensor([0.5, 0.25, -0.25, 2.0]))
    torch.testing.assert_close(truncation_penalty(rewards, truncated, 0.0),
                               torch.tensor([0.0, 0.0, 0.0, 2.0]))
    torch.testing.assert_close(truncation_penalty(rewards, truncated, -1.0),
                               torch.tensor([-1.0, -1.0, -1.0, 2.0]))


@pytest.mark.parametrize("criterion", ["mean", "std"])
def test_dynamic_filter_matches_reference(criterion: str) -> None:
    group_ids = torch.tensor([5, 2, 5, 9, 2, 9, 5, 2, 11, 11, 4])
    scores = torch.tensor([1, 0, 1, 1, 1, 0, 1, 0, 0, 0, 1], dtype=torch.float)
    got = dynamic_filter(scores, group_ids, low=0.0, high=1.0, criterion=criterion)
    want = []
    for gid in group_ids.tolist():
        group = [float(s) for s, g in zip(scores, group_ids.tolist()) if g == gid]
        if criterion == "mean":
            want.append(0.0 < statistics.fmean(group) < 1.0)
        else:
            want.append(len(group) > 1 and statistics.pstdev(group) > 0)
    assert got.dtype == torch.bool
    assert got.tolist() == want
    # Groups 2 and 9 are mixed; 5 is all-correct, 11 all-wrong, 4 a single sample.
    assert got.tolist() == [False, True, False, True, True, True, False, True, False, False, False]


def test_dynamic_filter_by_hand() -> None:
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    # Group 1: three 0.1 scores -- a float std can come out positive, max == min cannot.
    scores = torch.tensor([0.2, 0.5, 0.9, 0.1, 0.1, 0.1])
    assert dynamic_filter(scores, group_ids, criterion="std").tolist() == [True] * 3 + [False] * 3
    # Means 0.5625 and 0.25; the bounds are strict.
    scores = torch.tensor([0.25, 0.5, 0.9375, 0.25, 0.25, 0.25])
    keep = dynamic_filter(scores, group_ids, low=0.25, high=0.5625, criterion="mean")
    assert keep.tolist() == [False] * 6
    keep = dynamic_filter(scores, group_ids, low=0.0, high=0.6)
    assert keep.tolist() == [True] * 6
    keep = dynamic_filter(scores, group_ids, low=0.25 - 1e-6, high=0.5)
    assert keep.tolist() == [False] * 3 + [True] * 3


def test_error_messages() -> None:
    with pytest.raises(ValueError, match="Unknown dynamic filter criterion 'stdev'.*'std'"):
        dynamic_filter(torch.zeros(2), torch.zeros(2), criterion="stdev")
    with pytest.raises(ValueError, match="1-D of equal length"):
        dynamic_filter(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="0 < buffer <= max_new_tokens; got buffer=0"):
        overlong_penalty(torch.zeros(1), torch.zeros(1), max_new_tokens=8, buffer=0, factor=1.0)
    with pytest.raises(ValueError, match="must match"):
        truncation_penalty(torch.zeros(2), torch.zeros(3, dtype=torch.bool), 0.0)
