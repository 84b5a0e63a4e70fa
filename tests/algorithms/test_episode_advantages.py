"""Episodes in segments (a chat template that rewrote history): the layout against its loop
reference, every estimator against its run on the segments concatenated by hand, and the
outcome advantage of every segment equal to its episode's."""

from __future__ import annotations

import pytest
import torch

from agentrl.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages
from agentrl.algorithms.episode_layout import (
    episode_layout,
    from_episodes,
    to_episodes,
    to_episodes_reference,
)

from ._batches import make_batch

# gigpo and rtg_turn need state ids as well: tests/algorithms/test_gigpo.py holds them.
ESTIMATORS = sorted(set(ADVANTAGE_ESTIMATORS) - {"gigpo", "rtg_turn"})


def _segmented(seed: int):
    """A random batch whose rows are split into episodes of 1-3 segments within each group
    (rows of an episode in row order, episodes interleaved), and its episode ids."""
    b = make_batch(seed, group_sizes=(4, 5, 6, 3))
    gen = torch.Generator().manual_seed(seed)
    episode_ids, next_id = [], 100
    open_episodes: dict[int, list[int]] = {}  # group -> episode ids still taking rows
    for g in b.group_ids_B.tolist():
        pool = open_episodes.setdefault(g, [])
        # Two episodes a group at least (the group baselines need two samples).
        if len(pool) >= 2 and int(torch.randint(0, 3, (), generator=gen)) > 0:
            episode_ids.append(pool[int(torch.randint(0, len(pool), (), generator=gen))])
        else:
            pool.append(next_id)
            episode_ids.append(next_id)
            next_id += 7  # not dense, not sorted by appearance
    return b, torch.tensor(episode_ids)


def _by_hand(estimator: str, b, episode_ids: torch.Tensor, **kw) -> tuple[torch.Tensor, ...]:
    """The estimator on each episode's rows concatenated in a Python loop, then split back."""
    cat = {}
    for name in ("rewards_BT", "mask_BT", "values_BT", "kl_BT"):
        cat[name], order = to_episodes_reference(getattr(b, name), episode_ids)
    first = {e: int(b.group_ids_B[episode_ids.tolist().index(e)]) for e in order}
    adv, ret = compute_advantages(
        estimator, rewards_BT=cat["rewards_BT"], mask_BT=cat["mask_BT"],
        group_ids_B=torch.tensor([first[e] for e in order]),
        values_BT=cat["values_BT"] if estimator == "gae" else None, kl_BT=cat["kl_BT"], **kw)
    T = b.mask_BT.shape[1]
    out_adv, out_ret = torch.zeros_like(b.mask_BT), torch.zeros_like(b.mask_BT)
    for e_index, e in enumerate(order):
        rows = [r for r in range(len(episode_ids)) if int(episode_ids[r]) == e]
        for k, r in enumerate(rows):
            out_adv[r] = adv[e_index, k * T : (k + 1) * T]
            out_ret[r] = ret[e_index, k * T : (k + 1) * T]
    return out_adv, out_ret


@pytest.mark.parametrize("seed", range(4))
def test_layout_matches_its_loop_reference_and_round_trips(seed):
    b, episode_ids = _segmented(seed)
    x = torch.randn(b.mask_BT.shape)
    index_B, position_B, E, S = episode_layout(episode_ids)
    laid = to_episodes(x, index_B, position_B, E, S)
    reference, _ = to_episodes_reference(x, episode_ids)
    torch.testing.assert_close(laid[:, : reference.shape[1]], reference, rtol=0, atol=0)
    assert S > 1 and E < len(episode_ids)  # the batch does have segments
    torch.testing.assert_close(from_episodes(laid, index_B, position_B, S), x, rtol=0, atol=0)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("seed", range(3))
def test_every_estimator_equals_its_run_on_the_concatenated_segments(estimator, seed):
    b, episode_ids = _segmented(seed)
    kw = {"gamma": 0.9, "lam": 0.8} if estimator == "gae" else {}
    kw = {"gamma": 0.9} if estimator == "reinforce" else kw
    adv, ret = compute_advantages(
        estimator, rewards_BT=b.rewards_BT, mask_BT=b.mask_BT, group_ids_B=b.group_ids_B,
        values_BT=b.values_BT if estimator == "gae" else None, kl_BT=b.kl_BT, kl_coef=0.1,
        episode_ids_B=episode_ids, **kw)
    ref_adv, ref_ret = _by_hand(estimator, b, episode_ids, kl_coef=0.1, **kw)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-5, atol=1e-5)
    # Rows of their own episodes are as without episode ids.
    plain, _ = compute_advantages(
        estimator, rewards_BT=b.rewards_BT, mask_BT=b.mask_BT, group_ids_B=b.group_ids_B,
        values_BT=b.values_BT if estimator == "gae" else None, kl_BT=b.kl_BT, kl_coef=0.1,
        episode_ids_B=torch.arange(len(episode_ids)), **kw)
    alone, _ = compute_advantages(
        estimator, rewards_BT=b.rewards_BT, mask_BT=b.mask_BT, group_ids_B=b.group_ids_B,
        values_BT=b.values_BT if estimator == "gae" else None, kl_BT=b.kl_BT, kl_coef=0.1,
        **kw)
    torch.testing.assert_close(plain, alone, rtol=1e-6, atol=1e-6)


def test_each_segment_gets_its_episodes_outcome_advantage():
    """Two groups of two episodes; episode 0 in three segments, its reward on the last one.
    GRPO: each episode counts once in its group's baseline, and every action token of every
    segment gets (R - mean) / std of the episodes."""
    T = 6
    mask = torch.zeros(6, T)
    mask[:, 2:5] = 1.0
    rewards = torch.zeros(6, T)
    # rows: ep0 seg0, ep1, ep0 seg1, ep0 seg2 (reward 1), ep2 (reward 0.5), ep3 (reward 0)
    rewards[3, 4], rewards[4, 4] = 1.0, 0.5
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    episodes = torch.tensor([0, 1, 0, 0, 2, 3])
    adv, _ = compute_advantages("group_norm", rewards_BT=rewards, mask_BT=mask,
                                group_ids_B=groups, episode_ids_B=episodes)
    # Group 0: episodes 0 (1.0) and 1 (0.0): mean 0.5, unbiased std 0.7071.
    expected = {0: 0.5 / 0.5 ** 0.5, 1: -0.5 / 0.5 ** 0.5, 2: 0.25 / 0.125 ** 0.5,
                3: -0.25 / 0.125 ** 0.5}
    for row, e in enumerate(episodes.tolist()):
        torch.testing.assert_close(adv[row, 2:5], torch.full((3,), expected[e]),
                                   rtol=1e-5, atol=1e-6)
        assert bool((adv[row, :2] == 0).all()) and bool((adv[row, 5:] == 0).all())
    # Without episode ids the zero-reward segments would be samples of their own.
    alone, _ = compute_advantages("group_norm", rewards_BT=rewards, mask_BT=mask,
                                  group_ids_B=groups)
    assert float(alone[0, 2]) < 0 < float(adv[0, 2])


def test_segments_of_one_episode_in_two_groups_is_an_error():
    mask = torch.ones(3, 4)
    with pytest.raises(ValueError, match=r"segments of one episode must share a group; "
                                         r"episode 0 has rows in groups \[0, 1\]"):
        compute_advantages("group_norm", rewards_BT=torch.zeros(3, 4), mask_BT=mask,
                           group_ids_B=torch.tensor([0, 1, 1]),
                           episode_ids_B=torch.tensor([5, 5, 6]))
    with pytest.raises(ValueError, match=r"episode_ids_B must have shape \[3\]"):
        compute_advantages("reinforce", rewards_BT=torch.zeros(3, 4), mask_BT=mask,
                           episode_ids_B=torch.tensor([0, 1]))
