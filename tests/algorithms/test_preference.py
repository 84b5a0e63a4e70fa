"""Preference and SFT losses against plain-Python loops of the published formulas."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.algorithms.preference import (
    pairwise_accuracy,
    preference_loss,
    reward_model_loss,
    sequence_logprobs,
    sft_loss,
)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _pairs(seed: int = 0, n: int = 7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=torch.float64) * 3 - 10 for _ in range(4)]


@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_dpo_and_conservative_dpo_match_the_formula(beta, eps):
    pc, pr, rc, rr = _pairs()
    got = preference_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    for i in range(len(pc)):
        h = beta * ((pc[i] - rc[i]) - (pr[i] - rr[i])).item()
        want = -(1 - eps) * math.log(_sigmoid(h)) - eps * math.log(_sigmoid(-h))
        assert got.loss_B[i].item() == pytest.approx(want, rel=1e-9)
        assert got.chosen_reward_B[i].item() == pytest.approx(beta * (pc[i] - rc[i]).item())
        assert got.rejected_reward_B[i].item() == pytest.approx(beta * (pr[i] - rr[i]).item())


def test_ipo_regresses_the_log_ratio_gap_onto_one_over_two_beta():
    pc, pr, rc, rr = _pairs(1)
    beta = 0.25
    got = preference_loss(pc, pr, rc, rr, beta=beta, kind="ipo").loss_B
    for i in range(len(pc)):
        h = ((pc[i] - rc[i]) - (pr[i] - rr[i])).item()
        assert got[i].item() == pytest.approx((h - 1 / (2 * beta)) ** 2, rel=1e-9)
    # Its minimum is at the target gap, not at an infinite one (as DPO's is).
    gap = torch.tensor([1 / (2 * beta)], dtype=torch.float64)
    zero = torch.zeros(1, dtype=torch.float64)
    assert preference_loss(gap, zero, zero, zero, beta=beta, kind="ipo").loss_B.item() == 0


def test_dpo_is_stable_for_large_gaps_and_its_gradient_favours_the_chosen():
    pc = torch.tensor([300.0, -300.0], requires_grad=True)
    pr = torch.zeros(2)
    out = preference_loss(pc, pr, torch.zeros(2), torch.zeros(2), beta=1.0)
    assert torch.isfinite(out.loss_B).all() and out.loss_B[0] < 1e-6
    assert out.loss_B[1].item() == pytest.approx(300.0)
    out.loss_B.sum().backward()
    assert (pc.grad <= 0).all() and pc.grad[1] < 0  # raising log pi(chosen) lowers the loss


@pytest.mark.parametrize("kind", ["sigmoid", "logexp"])
def test_bradley_terry_losses(kind):
    c, r, m, _ = _pairs(2)
    got = reward_model_loss(c, r, kind=kind)
    for i in range(len(c)):
        want = math.log1p(math.exp((r[i] - c[i]).item()))
        assert got[i].item() == pytest.approx(want, rel=1e-9)
    margin = m.abs()
    with_margin = reward_model_loss(c, r, margin_B=margin)
    for i in range(len(c)):
        want = -math.log(_sigmoid((c[i] - r[i] - margin[i]).item()))
        assert with_margin[i].item() == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="takes no margin"):
        reward_model_loss(c, r, kind="logexp", margin_B=margin)


def test_sft_loss_and_sequence_logprobs():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert sequence_logprobs(logp, mask).tolist() == [-5.0, -0.75]
    assert sft_loss(logp, mask, num_tokens=8.0).item() == pytest.approx(5.75 / 8)
    assert pairwise_accuracy(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 2.0, 4.0])) == 0.5


def test_bad_settings_are_refused():
    x = torch.zeros(2)
    for kw, says in (({"beta": 0.0}, "beta must be > 0"),
                     ({"beta": 0.1, "label_smoothing": 0.5}, r"label_smoothing must be in"),
                     ({"beta": 0.1, "kind": "kto"}, "unknown preference loss"),
                     ({"beta": 0.1, "kind": "ipo", "label_smoothing": 0.1}, "IPO does not")):
        with pytest.raises(ValueError, match=says):
            preference_loss(x, x, x, x, **kw)
