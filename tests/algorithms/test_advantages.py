"""Advantage estimators against plain-loop references and hand-computed examples."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import Tensor

from agentrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    masked_mean,
    masked_whiten,
    register_advantage_estimator,
)
from agentrl.algorithms import advantages as adv_module

from ._batches import make_batch

# gigpo and rtg_turn need state ids as well: tests/algorithms/test_gigpo.py holds them.
ESTIMATORS = sorted(set(ADVANTAGE_ESTIMATORS) - {"gigpo", "rtg_turn"})

GROUP_ESTIMATORS = ["rloo", "reinforce_baseline", "dr_grpo", "group_norm"]
WHITEN_DEFAULT = {"gae": True, "reinforce": True, "reinforce_baseline": True}


def _reference_baselines(
    estimator: str, scores: list[float], ids: list[int]
) -> list[tuple[float, float]]:
    """(baseline, scale) per sample from the algorithms.md table, by explicit group loops."""
    out = []
    for i, gid in enumerate(ids):
        group = [scores[j] for j in range(len(ids)) if ids[j] == gid]
        others = [scores[j] for j in range(len(ids)) if ids[j] == gid and j != i]
        if estimator == "rloo":
            out.append((sum(others) / len(others), 1.0))
        elif estimator == "group_norm":
            out.append((statistics.fmean(group), statistics.stdev(group) + 1e-9))
        elif estimator in ("reinforce_baseline", "dr_grpo"):
            out.append((statistics.fmean(group), 1.0))
        else:
            out.append((0.0, 1.0))
    return out


def _reference_whiten(adv: list[list[float]], mask: list[list[float]], std: bool) -> None:
    flat = [a for row, m in zip(adv, mask) for a, w in zip(row, m) if w]
    mean = sum(flat) / len(flat)
    var = sum((a - mean) ** 2 for a in flat) / len(flat)
    for row, m in zip(adv, mask):
        for t, w in enumerate(m):
            if w:
                row[t] = (row[t] - mean) / (math.sqrt(max(var, 1e-8)) if std else 1.0)


def _reference_advantages(
    estimator: str, rewards: Tensor, mask: Tensor, group_ids: Tensor, values: Tensor,
    kl: Tensor, *, gamma: float, lam: float, kl_coef: float, whiten: bool, whiten_std: bool = True,
) -> tuple[list[list[float]], list[list[float]]]:
    """Direct sums over the future action tokens (no recursion), then whitening; a group
    estimator's (score - baseline) / scale on every action token of the sample."""
    R, M, V, K = rewards.tolist(), mask.tolist(), values.tolist(), kl.tolist()
    B, T = len(R), len(R[0])
    actions = [[t for t in range(T) if M[b][t]] for b in range(B)]
    scores = [sum(R[b][t] for t in actions[b]) for b in range(B)]
    baselines = _reference_baselines(estimator, scores, group_ids.tolist())
    if estimator in GROUP_ESTIMATORS:
        gamma = 1.0
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        base, scale = baselines[b]
        for k, t in enumerate(actions[b]):
            future = actions[b][k:]
            shaped = [R[b][u] - kl_coef * K[b][u] for u in future]
            if estimator == "gae":
                next_v = [V[b][u] for u in future[1:]] + [0.0]
                deltas = [shaped[m] + gamma * next_v[m] - V[b][u] for m, u in enumerate(future)]
                adv[b][t] = sum((gamma * lam) ** m * d for m, d in enumerate(deltas))
                ret[b][t] = adv[b][t] + V[b][t]
            elif estimator in GROUP_ESTIMATORS:
                # The outcome advantage on every action token, plus the future KL penalty.
                future_kl = sum(kl_coef * K[b][u] for u in future)
                ret[b][t] = adv[b][t] = (scores[b] - base) / scale - future_kl
            else:
                ret[b][t] = adv[b][t] = sum(gamma**m * s for m, s in enumerate(shaped))
    if whiten:
        _reference_whiten(adv, M, whiten_std)
    return adv, ret


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_matches_reference_on_random_multi_turn_batches(
    estimator: str, kl_coef: float, seed: int
) -> None:
    batch = make_batch(seed)
    gamma, lam = (1.0, 1.0) if estimator in GROUP_ESTIMATORS else (0.9, 0.8)
    kwargs = {"values_BT": batch.values_BT} if estimator == "gae" else {}
    adv, ret = compute_advantages(
        estimator, rewards_BT=batch.rewards_BT, mask_BT=batch.mask_BT,
        group_ids_B=batch.group_ids_B, gamma=gamma, lam=lam if estimator == "gae" else 1.0,
        kl_BT=batch.kl_BT, kl_coef=kl_coef, **kwargs,
    )
    ref_adv, ref_ret = _reference_advantages(
        estimator, batch.rewards_BT, batch.mask_BT, batch.group_ids_B, batch.values_BT,
        batch.kl_BT, gamma=gamma, lam=lam, kl_coef=kl_coef,
        whiten=WHITEN_DEFAULT.get(estimator, False),
    )
    torch.testing.assert_close(adv, torch.tensor(ref_adv), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, torch.tensor(ref_ret), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("whiten", "whiten_std"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("estimator", ["rloo", "reinforce", "gae"])
def test_whitening_options_match_reference(estimator: str, whiten: bool, whiten_std: bool) -> None:
    batch = make_batch(3)
    adv, _ = compute_advantages(
        estimator, rewards_BT=batch.rewards_BT, mask_BT=batch.mask_BT,
        group_ids_B=batch.group_ids_B, values_BT=batch.values_BT if estimator == "gae" else None,
        whiten=whiten, whiten_std=whiten_std,
    )
    ref_adv, _ = _reference_advantages(
        estimator, batch.rewards_BT, batch.mask_BT, batch.group_ids_B, batch.values_BT,
        batch.kl_BT, gamma=1.0, lam=1.0, kl_coef=0.0, whiten=whiten, whiten_std=whiten_std,
    )
    torch.testing.assert_close(adv, torch.tensor(ref_adv), atol=1e-5, rtol=1e-5)
    if whiten:
        assert abs(float(masked_mean(adv, batch.mask_BT))) < 1e-5


def _single_turn(scores: list[float], length: int = 3) -> tuple[Tensor, Tensor]:
    """Rows ``prompt, prompt, action x length, pad`` with the score on the last action token."""
    mask = torch.zeros(len(scores), length + 3)
    mask[:, 2 : 2 + length] = 1.0
    rewards = torch.zeros_like(mask)
    rewards[:, 1 + length] = torch.tensor(scores)
    return rewards, mask


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        # scores 1, 2, 6: leave-one-out means 4, 3.5, 1.5.
        ("rloo", [-3.0, -1.5, 4.5]),
        ("dr_grpo", [-2.0, -1.0, 3.0]),
        # mean 3, unbiased std sqrt(7).
        ("group_norm", [-2 / math.sqrt(7), -1 / math.sqrt(7), 3 / math.sqrt(7)]),
    ],
)
def test_single_turn_group_baselines_by_hand(estimator: str, expected: list[float]) -> None:
    rewards, mask = _single_turn([1.0, 2.0, 6.0])
    adv, ret = compute_advantages(
        estimator, rewards_BT=rewards, mask_BT=mask, group_ids_B=torch.tensor([4, 4, 4])
    )
    want = torch.tensor(expected)[:, None] * mask
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(ret, want)


def test_group_estimators_give_every_turn_the_outcome_advantage_by_hand() -> None:
    # Two samples, two turns each; sample 0 earns 1 then 2 (score 3), sample 1 earns 0 then 1.
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0], [0, 1, 0, 0, 1, 1, 1]], dtype=torch.float)
    rewards = torch.zeros_like(mask)
    rewards[0, 2], rewards[0, 5] = 1.0, 2.0
    rewards[1, 1], rewards[1, 6] = 0.0, 1.0
    adv, _ = compute_advantages(
        "dr_grpo", rewards_BT=rewards, mask_BT=mask, group_ids_B=torch.tensor([0, 0])
    )
    # Mean score 2: sample 0's turns both get 3 - 2, sample 1's both 1 - 2 (GRPO's outcome
    # advantage; the second turn of sample 0 is not judged by its reward-to-go 2 - 2).
    want = torch.tensor([[0, 1, 1, 0, 0, 1, 0], [0, -1, 0, 0, -1, -1, -1]], dtype=torch.float)
    torch.testing.assert_close(adv, want)


def test_gae_by_hand() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7, 9.0]])
    adv, ret = compute_advantages(
        "gae", rewards_BT=rewards, mask_BT=mask, values_BT=values, gamma=0.9, lam=0.8,
        whiten=False,
    )
    # deltas: 0.9*0.6-0.5 = 0.04, 0.9*0.7-0.6 = 0.03, 1-0.7 = 0.3; A_t = delta_t + 0.72 A_next.
    a2, a1 = 0.3, 0.03 + 0.72 * 0.3
    a0 = 0.04 + 0.72 * a1
    torch.testing.assert_close(adv, torch.tensor([[0.0, a0, a1, a2, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, a0 + 0.5, a1 + 0.6, a2 + 0.7, 0.0]]))


def _insert_observations(x: Tensor, at: list[int], fill: Tensor) -> Tensor:
    """Insert one column per index of ``at`` (ascending, in the original numbering)."""
    columns = list(x.unbind(1))
    for k, t in enumerate(at):
        columns.insert(t + k, fill[:, k])
    return torch.stack(columns, 1)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_observation_tokens_neither_discount_nor_bootstrap(estimator: str) -> None:
    batch = make_batch(4)
    B = batch.mask_BT.shape[0]
    at = [2, 5, 5, 9, 14]
    noise = torch.randn(B, len(at))
    longer = {
        "rewards_BT": _insert_observations(batch.rewards_BT, at, torch.zeros(B, len(at))),
        "mask_BT": _insert_observations(batch.mask_BT, at, torch.zeros(B, len(at))),
        "values_BT": _insert_observations(batch.values_BT, at, noise),
        "kl_BT": _insert_observations(batch.kl_BT, at, noise),
    }
    kwargs = {"group_ids_B": batch.group_ids_B, "kl_coef": 0.05}
    if estimator in ("gae", "reinforce"):
        kwargs.update(gamma=0.9, lam=0.7 if estimator == "gae" else 1.0)
    if estimator == "gae":
        short = compute_advantages(estimator, rewards_BT=batch.rewards_BT, mask_BT=batch.mask_BT,
                                   values_BT=batch.values_BT, kl_BT=batch.kl_BT, **kwargs)
        long = compute_advantages(estimator, **longer, **kwargs)
    else:
        short = compute_advantages(estimator, rewards_BT=batch.rewards_BT, mask_BT=batch.mask_BT,
                                   kl_BT=batch.kl_BT, **kwargs)
        longer.pop("values_BT")
        long = compute_advantages(estimator, **longer, **kwargs)
    action_long = longer["mask_BT"] != 0
    for s, lg in zip(short, long):
        torch.testing.assert_close(lg[action_long], s[batch.mask_BT != 0])


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_outputs_are_zero_off_mask_and_carry_no_gradient(estimator: str) -> None:
    batch = make_batch(5)
    values = batch.values_BT.clone().requires_grad_(True)
    adv, ret = compute_advantages(
        estimator, rewards_BT=batch.rewards_BT, mask_BT=batch.mask_BT,
        group_ids_B=batch.group_ids_B, values_BT=values if estimator == "gae" else None,
    )
    off = batch.mask_BT == 0
    assert not adv.requires_grad and not ret.requires_grad
    assert bool((adv[off] == 0).all()) and bool((ret[off] == 0).all())
    assert adv.dtype == torch.float32 and adv.shape == batch.mask_BT.shape


def test_constant_group_gets_exactly_zero_group_norm_advantage() -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point; divided by std + 1e-9 that error would be huge.
    rewards, mask = _single_turn([0.1, 0.1, 0.1, 0.3, 0.7])
    adv, _ = compute_advantages(
        "group_norm", rewards_BT=rewards, mask_BT=mask, group_ids_B=torch.tensor([0, 0, 0, 1, 1])
    )
    assert bool((adv[:3] == 0).all())
    # 0.3, 0.7: mean 0.5, unbiased std sqrt(0.08) -> -+0.2 / sqrt(0.08) = -+1 / sqrt(2).
    torch.testing.assert_close(adv[3:, 2], torch.tensor([-1.0, 1.0]) / math.sqrt(2))


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo", "reinforce_baseline"])
def test_a_constant_multi_turn_group_gets_zero_advantage_on_every_turn(estimator: str) -> None:
    """Three turns rewarded 1/3 each in every sample: no signal, so no advantage anywhere, also
    on the later turns whose rewards-to-go (2/3, 1/3) differ from the group's score (1)."""
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0, 1, 1]] * 5, dtype=torch.float32)
    rewards = torch.zeros_like(mask)
    rewards[:, [2, 5, 8]] = 1 / 3
    rewards[3:, 8] = 0.0  # group 1: both samples missed their last step
    groups = torch.tensor([0, 0, 0, 1, 1])
    adv, _ = compute_advantages(estimator, rewards_BT=rewards, mask_BT=mask, group_ids_B=groups)
    assert bool((adv == 0).all())
    # One group of scores 1, 1, 1, 2/3, 2/3: each sample's outcome advantage on every one of
    # its action tokens, the correct last turns of the solved samples included.
    adv2, _ = compute_advantages(estimator, rewards_BT=rewards, mask_BT=mask,
                                 group_ids_B=torch.tensor([0, 0, 0, 0, 0]))
    for b in range(5):
        on = adv2[b][mask[b] == 1]
        assert bool((on == on[0]).all()) and bool((adv2[b][mask[b] == 0] == 0).all())
    assert bool((adv2[:3, 1] > 0).all()) and bool((adv2[3:, 1] < 0).all())


def test_group_estimator_forces_gamma_one_with_a_warning() -> None:
    batch = make_batch(6)
    kwargs = {"rewards_BT": batch.rewards_BT, "mask_BT": batch.mask_BT,
              "group_ids_B": batch.group_ids_B}
    with pytest.warns(UserWarning, match=r"'rloo' estimator uses gamma=1.*gamma=0.9 is ignored"):
        adv, _ = compute_advantages("rloo", gamma=0.9, **kwargs)
    torch.testing.assert_close(adv, compute_advantages("rloo", **kwargs)[0])


def test_reward_clip_applies_before_the_baseline() -> None:
    rewards, mask = _single_turn([20.0, 0.0])
    adv, _ = compute_advantages(
        "rloo", rewards_BT=rewards, mask_BT=mask, group_ids_B=torch.tensor([0, 0]), reward_clip=10
    )
    torch.testing.assert_close(adv[:, 2], torch.tensor([10.0, -10.0]))


def test_discounted_returns_matches_reference() -> None:
    batch = make_batch(7)
    R, M = batch.rewards_BT.tolist(), batch.mask_BT.tolist()
    for gamma in (1.0, 0.7):
        want = [[0.0] * len(R[0]) for _ in R]
        for b, row in enumerate(M):
            actions = [t for t, m in enumerate(row) if m]
            for k, t in enumerate(actions):
                want[b][t] = sum(gamma**j * R[b][u] for j, u in enumerate(actions[k:]))
        got = discounted_returns(batch.rewards_BT, batch.mask_BT, gamma)
        torch.testing.assert_close(got, torch.tensor(want))


def test_masked_mean_and_whiten_match_reference_and_ignore_masked_nan() -> None:
    x = torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.4).float()
    x_with_nan = torch.where(mask == 0, torch.nan, x)
    values = [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    torch.testing.assert_close(masked_mean(x_with_nan, mask), torch.tensor(mean))
    rows = [[v for v, m in zip(xr, mr) if m] for xr, mr in zip(x.tolist(), mask.tolist())]
    torch.testing.assert_close(
        masked_mean(x_with_nan, mask, dim=1),
        torch.tensor([sum(r) / len(r) if r else 0.0 for r in rows]),
    )
    torch.testing.assert_close(masked_whiten(x_with_nan, mask), (x - mean) / std * mask)
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False), x / std * mask)
    assert float(masked_mean(x, torch.zeros_like(mask))) == 0.0


def test_register_custom_estimator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adv_module, "ADVANTAGE_ESTIMATORS", dict(ADVANTAGE_ESTIMATORS))
    monkeypatch.setattr(adv_module, "_WHITEN_BY_DEFAULT", dict(adv_module._WHITEN_BY_DEFAULT))

    def doubled(*, rewards_BT: Tensor, mask_BT: Tensor, **_: object) -> tuple[Tensor, Tensor]:
        returns = discounted_returns(2 * rewards_BT, mask_BT, 1.0)
        return returns, returns

    register_advantage_estimator("doubled", doubled)
    rewards, mask = _single_turn([1.5])
    adv, _ = compute_advantages("doubled", rewards_BT=rewards, mask_BT=mask)
    torch.testing.assert_close(adv, 3.0 * mask)
    with pytest.raises(ValueError, match="'doubled' is already registered.*overwrite=True"):
        register_advantage_estimator("doubled", doubled)
    register_advantage_estimator("doubled", doubled, whiten_by_default=True, overwrite=True)
    adv, _ = compute_advantages("doubled", rewards_BT=rewards, mask_BT=mask)
    torch.testing.assert_close(adv, torch.zeros_like(mask))  # one token, whitened to 0


def test_error_messages() -> None:
    rewards, mask = _single_turn([1.0, 0.0, 1.0])
    kwargs = {"rewards_BT": rewards, "mask_BT": mask}
    with pytest.raises(ValueError, match="Unknown advantage estimator 'grop_norm'.*'group_norm'"):
        compute_advantages("grop_norm", **kwargs)
    with pytest.raises(ValueError, match="at least 2 samples per group; groups \\[5\\] have 1"):
        compute_advantages("group_norm", group_ids_B=torch.tensor([1, 1, 5]), **kwargs)
    with pytest.raises(ValueError, match="'rloo' estimator compares samples.*pass group_ids_B"):
        compute_advantages("rloo", **kwargs)
    with pytest.raises(ValueError, match=r"group_ids_B must have shape \[3\]"):
        compute_advantages("rloo", group_ids_B=torch.tensor([1, 1]), **kwargs)
    with pytest.raises(ValueError, match="'gae' estimator needs critic values"):
        compute_advantages("gae", **kwargs)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs kl_BT"):
        compute_advantages("reinforce", kl_coef=0.1, **kwargs)
    with pytest.raises(ValueError, match="values_BT must have the shape of mask_BT"):
        compute_advantages("gae", values_BT=torch.zeros(3, 2), **kwargs)
    off_mask = rewards.clone()
    off_mask[0, 0] = 1.0
    with pytest.raises(ValueError, match="non-zero on tokens where mask_BT is 0"):
        compute_advantages("reinforce", rewards_BT=off_mask, mask_BT=mask)
    with pytest.warns(UserWarning, match="lam is ignored by the 'reinforce' estimator"):
        compute_advantages("reinforce", lam=0.95, **kwargs)
