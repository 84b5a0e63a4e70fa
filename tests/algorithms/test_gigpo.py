"""GiGPO: the anchor grouping and the advantages against a hand-computed example, the
vectorised step level against its loop reference, its reduction to GRPO, and segments; and
rtg_turn, which groups the same steps by turn index instead of state, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.algorithms import compute_advantages
from agentrl.algorithms.gigpo import (
    anchor_groups,
    per_step,
    step_advantages,
    step_advantages_reference,
    token_steps,
)

from ._batches import make_batch
from .test_episode_advantages import _segmented


def _rows(episodes: list[list[tuple[int, float, int]]]) -> tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """``rewards_BT, mask_BT, state_ids_BT`` of episodes given as steps ``(state, reward,
    tokens)``: a prompt token, then each step's action tokens and an observation token."""
    T = 1 + max(sum(n + 1 for _, _, n in steps) for steps in episodes)
    rewards, mask = torch.zeros(len(episodes), T), torch.zeros(len(episodes), T)
    states = torch.zeros(len(episodes), T, dtype=torch.long)
    for b, steps in enumerate(episodes):
        t = 1
        for state, reward, n in steps:
            mask[b, t : t + n] = 1.0
            rewards[b, t + n - 1], states[b, t + n - 1] = reward, state
            t += n + 1
    return rewards, mask, states


# Two groups whose episodes visit the states 1 and 2 (10: the prompt). Group 0, gamma 0.5:
#   a: 10 (r 0) -> 1 (r 0) -> 2 (r 1)   returns 0.25, 0.5, 1
#   b: 10 (r 0) -> 1 (r 1)              returns 0.5, 1
#   c: 10 (r 0) -> 2 (r 0) -> 1 (r 0)   returns 0, 0, 0
# anchor 1: a 0.5, b 1, c 0 -> mean 0.5, std 0.5         -> A^S 0, +1, -1
# anchor 2: a 1, c 0        -> mean 0.5, std sqrt(0.5)   -> A^S +-1/sqrt(2)
# episodes: scores 1, 1, 0  -> mean 2/3, std 1/sqrt(3)   -> A^E 1/sqrt(3), 1/sqrt(3), -2/sqrt(3)
# Group 1 (same state ids, a group of its own):
#   d: 10 (r 0) -> 1 (r 0)              returns 0, 0
#   e: 10 (r 0) -> 1 (r 0) -> 2 (r 1)   returns 0.25, 0.5, 1
# anchor 1: d 0, e 0.5 -> A^S -+1/sqrt(2); anchor 2: e alone -> 0
# episodes: 0, 1 -> A^E -+1/sqrt(2)
EPISODES = [
    [(10, 0.0, 2), (1, 0.0, 1), (2, 1.0, 3)],
    [(10, 0.0, 1), (1, 1.0, 2)],
    [(10, 0.0, 1), (2, 0.0, 1), (1, 0.0, 2)],
    [(10, 0.0, 2), (1, 0.0, 1)],
    [(10, 0.0, 1), (1, 0.0, 1), (2, 1.0, 1)],
]
GROUPS = torch.tensor([0, 0, 0, 1, 1])
R2, R3 = 1 / math.sqrt(2), 1 / math.sqrt(3)
STEP_ADV = [[0.0, 0.0, R2], [0.0, 1.0], [0.0, -R2, -1.0], [0.0, -R2], [0.0, R2, 0.0]]
EPISODE_ADV = [R3, R3, -2 * R3, -R2, R2]


def _on_tokens(per_step_values: list[list[float]], per_episode: list[float] | None = None
               ) -> torch.Tensor:
    """Each step's value on every action token of the step (plus its episode's value)."""
    _, mask, _ = _rows(EPISODES)
    out = torch.zeros_like(mask)
    for b, steps in enumerate(EPISODES):
        t = 1
        for k, (_, _, n) in enumerate(steps):
            out[b, t : t + n] = per_step_values[b][k] + (per_episode[b] if per_episode else 0)
            t += n + 1
    return out


def test_anchor_groups_by_hand() -> None:
    _, mask, states = _rows(EPISODES)
    step_BT, num_steps_B = token_steps(states, mask)
    assert num_steps_B.tolist() == [3, 2, 3, 2, 3]
    K = int(num_steps_B.max())
    anchor_BK, num_anchors = anchor_groups(per_step(states, step_BT, K), GROUPS, num_steps_B)
    # (group 0, state 1), (group 0, state 2), (group 1, state 1), (group 1, state 2); the first
    # steps and the steps past an episode's end belong to none.
    assert num_anchors == 4
    g0s1, g0s2 = int(anchor_BK[0, 1]), int(anchor_BK[0, 2])
    g1s1, g1s2 = int(anchor_BK[3, 1]), int(anchor_BK[4, 2])
    assert len({g0s1, g0s2, g1s1, g1s2}) == 4
    assert anchor_BK.tolist() == [[-1, g0s1, g0s2], [-1, g0s1, -1], [-1, g0s2, g0s1],
                                  [-1, g1s1, -1], [-1, g1s1, g1s2]]


def test_step_and_combined_advantages_by_hand() -> None:
    rewards, mask, states = _rows(EPISODES)
    step = step_advantages(rewards, mask, states, GROUPS, gamma=0.5)
    torch.testing.assert_close(step, _on_tokens(STEP_ADV))
    adv, ret = compute_advantages("gigpo", rewards_BT=rewards, mask_BT=mask, group_ids_B=GROUPS,
                                  state_ids_BT=states, step_gamma=0.5, step_weight=1.0)
    torch.testing.assert_close(adv, _on_tokens(STEP_ADV, EPISODE_ADV))
    zeros = [[0.0] * len(steps) for steps in EPISODES]
    torch.testing.assert_close(ret, _on_tokens(zeros, EPISODE_ADV))  # A^E's returns
    half, _ = compute_advantages("gigpo", rewards_BT=rewards, mask_BT=mask, group_ids_B=GROUPS,
                                 state_ids_BT=states, step_gamma=0.5, step_weight=0.5)
    torch.testing.assert_close(half, _on_tokens([[v / 2 for v in r] for r in STEP_ADV],
                                                EPISODE_ADV))


def test_without_std_division_by_hand() -> None:
    rewards, mask, states = _rows(EPISODES)
    step = step_advantages(rewards, mask, states, GROUPS, gamma=0.5, divide_std=False)
    # anchor (0, 1): 0.5, 1, 0 less 0.5; (0, 2): 1, 0 less 0.5; (1, 1): 0, 0.5 less 0.25.
    expect = [[0.0, 0.0, 0.5], [0.0, 0.5], [0.0, -0.5, -0.5], [0.0, -0.25], [0.0, 0.25, 0.0]]
    torch.testing.assert_close(step, _on_tokens(expect))


def _with_states(seed: int, num_states: int) -> tuple[object, torch.Tensor]:
    """A random batch and state ids 1..num_states on the last action token of every turn."""
    b = make_batch(seed, group_sizes=(4, 5, 6, 3))
    gen = torch.Generator().manual_seed(seed + 100)
    mask = b.mask_BT
    nxt = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
    ends = (mask != 0) & (nxt == 0)
    states = torch.randint(1, num_states + 1, mask.shape, generator=gen) * ends
    return b, states


@pytest.mark.parametrize("divide_std", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_step_advantages_match_the_loop_reference(seed: int, divide_std: bool) -> None:
    b, states = _with_states(seed, num_states=2)
    fast = step_advantages(b.rewards_BT, b.mask_BT, states, b.group_ids_B, gamma=0.9,
                           divide_std=divide_std)
    slow = step_advantages_reference(b.rewards_BT, b.mask_BT, states, b.group_ids_B, gamma=0.9,
                                     divide_std=divide_std)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    assert bool(fast.ne(0).any())  # the batch does have anchors with a signal
    assert bool((fast[b.mask_BT == 0] == 0).all())


@pytest.mark.parametrize("seed", range(3))
def test_no_recurring_state_is_group_norm_exactly(seed: int) -> None:
    """Every step in a state of its own (tool outputs that differ, single-turn tasks): GiGPO's
    advantages are GRPO's, bit for bit, KL shaping included."""
    b, states = _with_states(seed, num_states=1)
    unique = torch.arange(1, states.numel() + 1).reshape(states.shape) * (states != 0)
    kw = {"rewards_BT": b.rewards_BT, "mask_BT": b.mask_BT, "group_ids_B": b.group_ids_B,
          "kl_BT": b.kl_BT, "kl_coef": 0.1}
    grpo = compute_advantages("group_norm", **kw)
    gigpo = compute_advantages("gigpo", state_ids_BT=unique, **kw)
    for x, y in zip(gigpo, grpo, strict=True):
        assert torch.equal(x, y)
    # One shared state: the step level does contribute.
    shared, _ = compute_advantages("gigpo", state_ids_BT=states, **kw)
    assert not torch.equal(shared, grpo[0])


def test_a_state_revisited_in_one_episode_counts_each_visit() -> None:
    """One episode returns to state 1: its two visits are two members of the anchor group."""
    rewards, mask, states = _rows([[(10, 0.0, 1), (1, 0.0, 1), (1, 1.0, 1)],
                                   [(10, 0.0, 1), (2, 0.0, 1)]])
    step = step_advantages(rewards, mask, states, torch.tensor([0, 0]), gamma=0.5)
    # anchor 1: returns 0.5 and 1 -> -+1/sqrt(2); state 2 alone -> 0.
    assert step[0, 3].item() == pytest.approx(-R2) and step[0, 5].item() == pytest.approx(R2)
    assert step[1, 3].item() == 0.0


# rtg_turn on the same episodes: each turn against the same turn of its group's episodes.
# gamma 1: group 0's returns by turn a 1 1 1, b 1 1, c 0 0 0: turns 1 and 2 as the episodes
# (1, 1, 0 -> R3, R3, -2 R3), turn 3 a 1 and c 0 (+-R2); group 1: d 0 0, e 1 1 1 -> -+R2 on
# turns 1 and 2, e alone on turn 3 -> 0.
RTG_ADV = [[R3, R3, R2], [R3, R3], [-2 * R3, -2 * R3, -R2], [-R2, -R2], [R2, R2, 0.0]]
# gamma 0.5: a .25 .5 1, b .5 1, c 0 0 0: turn 1 (.25, .5, 0) -> 0, 1, -1; turn 2 (.5, 1, 0)
# -> 0, 1, -1; turn 3 +-R2; group 1: d 0 0, e .25 .5 1 -> -+R2, -+R2, 0.
RTG_ADV_HALF = [[0.0, 0.0, R2], [1.0, 1.0], [-1.0, -1.0, -R2], [-R2, -R2], [R2, R2, 0.0]]


def test_rtg_turn_by_hand() -> None:
    rewards, mask, states = _rows(EPISODES)
    for gamma, expect in ((1.0, RTG_ADV), (0.5, RTG_ADV_HALF)):
        adv, ret = compute_advantages("rtg_turn", rewards_BT=rewards, mask_BT=mask,
                                      group_ids_B=GROUPS, state_ids_BT=states, gamma=gamma)
        torch.testing.assert_close(adv, _on_tokens(expect))
        torch.testing.assert_close(ret, adv)
    # Only where each turn ends matters, not which state it names.
    adv, _ = compute_advantages("rtg_turn", rewards_BT=rewards, mask_BT=mask, group_ids_B=GROUPS,
                                state_ids_BT=(states != 0).long() * 7)
    torch.testing.assert_close(adv, _on_tokens(RTG_ADV))
    with pytest.raises(ValueError, match="'rtg_turn'.*state_ids_BT=\\[B, T\\].*'group_norm'"):
        compute_advantages("rtg_turn", rewards_BT=rewards, mask_BT=mask, group_ids_B=GROUPS)
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        compute_advantages("rtg_turn", rewards_BT=rewards, mask_BT=mask, state_ids_BT=states,
                           group_ids_B=torch.tensor([0, 0, 0, 1, 2]))


@pytest.mark.parametrize("estimator", ["gigpo", "rtg_turn"])
@pytest.mark.parametrize("seed", range(3))
def test_segments_are_estimated_as_their_episode(seed: int, estimator: str) -> None:
    """An episode in several rows (a template that rewrote history) is one sequence: its
    steps in every segment are grouped and returned as if the rows were concatenated."""
    b, episode_ids = _segmented(seed)
    mask = b.mask_BT
    nxt = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
    states = torch.randint(1, 3, mask.shape, generator=torch.Generator().manual_seed(seed))
    states = states * ((mask != 0) & (nxt == 0))
    kw = {"group_ids_B": b.group_ids_B, "step_gamma": 0.9}
    adv, _ = compute_advantages(estimator, rewards_BT=b.rewards_BT, mask_BT=mask,
                                state_ids_BT=states, episode_ids_B=episode_ids, **kw)
    order = sorted(set(episode_ids.tolist()))
    rows = {e: [r for r in range(len(episode_ids)) if int(episode_ids[r]) == e] for e in order}
    cat = {name: torch.stack([torch.cat([x[r] for r in rows[e]] + [
        torch.zeros(mask.shape[1] * (max(map(len, rows.values())) - len(rows[e])),
                    dtype=x.dtype)]) for e in order])
        for name, x in (("rewards_BT", b.rewards_BT), ("mask_BT", mask), ("state_ids_BT", states))}
    groups = torch.tensor([int(b.group_ids_B[rows[e][0]]) for e in order])
    whole, _ = compute_advantages(estimator, **cat, group_ids_B=groups, step_gamma=0.9)
    T = mask.shape[1]
    for i, e in enumerate(order):
        for k, r in enumerate(rows[e]):
            torch.testing.assert_close(adv[r], whole[i, k * T : (k + 1) * T])


def test_gigpo_without_state_ids_says_what_to_pass() -> None:
    rewards, mask, _ = _rows(EPISODES)
    with pytest.raises(ValueError, match="state_ids_BT=\\[B, T\\].*or use 'group_norm'"):
        compute_advantages("gigpo", rewards_BT=rewards, mask_BT=mask, group_ids_B=GROUPS)
    with pytest.raises(ValueError, match="state_ids_BT must have the shape of mask_BT"):
        compute_advantages("gigpo", rewards_BT=rewards, mask_BT=mask, group_ids_B=GROUPS,
                           state_ids_BT=torch.zeros(2, 2, dtype=torch.long))
