"""KL estimators and the adaptive coefficient."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.algorithms import KL_ESTIMATORS, adaptive_kl_coef, kl_estimate

from ._batches import make_batch


def _reference_kl(name: str, logp: float, ref: float) -> float:
    log_ratio = logp - ref
    if name == "k1":
        value = log_ratio
    elif name == "k2":
        value = log_ratio**2 / 2
    else:
        value = math.exp(-log_ratio) - 1 + log_ratio if log_ratio > -30 else math.inf
    return min(max(value, -10.0), 10.0)


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_kl_matches_reference_including_clamp(name: str) -> None:
    batch = make_batch(0)
    ref = batch.logp_BT + 2.0 * torch.randn_like(batch.logp_BT)
    ref[0, :3] = torch.tensor([-60.0, 60.0, 0.0])  # far outside the clamp on both sides
    got = kl_estimate(name, batch.logp_BT, ref)
    want = [
        [_reference_kl(name, float(a), float(r)) for a, r in zip(row_a, row_r)]
        for row_a, row_r in zip(batch.logp_BT, ref)
    ]
    torch.testing.assert_close(got, torch.tensor(want))
    assert float(got.abs().max()) == 10.0


def test_kl_estimators_by_hand() -> None:
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    # log r = log 2.
    torch.testing.assert_close(kl_estimate("k1", logp, ref), torch.tensor([[math.log(2)]]))
    torch.testing.assert_close(kl_estimate("k2", logp, ref), torch.tensor([[math.log(2) ** 2 / 2]]))
    torch.testing.assert_close(
        kl_estimate("k3", logp, ref), torch.tensor([[0.5 - 1 + math.log(2)]])
    )


def test_k3_gradient_is_finite_where_the_ratio_overflows() -> None:
    logp = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.5]])
    kl = kl_estimate("k3", logp, ref)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    assert bool(torch.isfinite(grad).all())
    # Clamped token: no gradient; the other: d/dx (e^-x - 1 + x) = 1 - e^-x at x = 0.5.
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1 - math.exp(-0.5)]]))


def test_adaptive_kl_coef_by_hand() -> None:
    # Above target: error clipped to +0.2.
    assert adaptive_kl_coef(0.1, 0.5, target=0.1, horizon=10_000, n_steps=64) == pytest.approx(
        0.1 * (1 + 0.2 * 64 / 10_000)
    )
    # Below target: error 0.09 / 0.1 - 1 = -0.1.
    assert adaptive_kl_coef(0.1, 0.09, target=0.1, horizon=1_000, n_steps=100) == pytest.approx(
        0.1 * (1 - 0.1 * 0.1)
    )
    assert adaptive_kl_coef(0.1, 0.1, target=0.1, horizon=1_000, n_steps=100) == pytest.approx(0.1)


def test_error_messages() -> None:
    zeros = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="Unknown KL estimator 'kl3'.*Did you mean 'k3'"):
        kl_estimate("kl3", zeros, zeros)
    with pytest.raises(ValueError, match="must have the same shape"):
        kl_estimate("k1", zeros, torch.zeros(2, 1))
    with pytest.raises(ValueError, match="target > 0 and horizon > 0; got target=0"):
        adaptive_kl_coef(0.1, 0.1, target=0.0, horizon=1.0, n_steps=1)
