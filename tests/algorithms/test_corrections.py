"""Sampler/trainer mismatch corrections against loops and hand examples."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from agentrl.algorithms import MISMATCH_CORRECTIONS, logprob_mismatch, mismatch_weights

from ._batches import make_batch


def _reference_weights(name: str, old: Tensor, rollout: Tensor, mask: Tensor, low: float,
                       high: float) -> list[list[float]]:
    out = []
    for o_row, r_row, m_row in zip(old.tolist(), rollout.tolist(), mask.tolist()):
        diffs = [o - r for o, r, m in zip(o_row, r_row, m_row) if m]
        rho_seq = math.exp(sum(diffs) / len(diffs)) if diffs else 1.0
        row = []
        for o, r, m in zip(o_row, r_row, m_row):
            rho = math.exp(o - r)
            if not m:
                row.append(0.0)
            elif name == "tis":
                row.append(min(max(rho, low), high))
            elif name == "icepop":
                row.append(rho if low <= rho <= high else 0.0)
            else:
                row.append(min(max(rho, low), high) if low <= rho_seq <= high else 0.0)
        out.append(row)
    return out


@pytest.mark.parametrize("name", sorted(MISMATCH_CORRECTIONS))
@pytest.mark.parametrize("seed", [0, 1])
def test_weights_match_reference(name: str, seed: int) -> None:
    batch = make_batch(seed)
    old = batch.logp_BT.clone().requires_grad_(True)
    # Log-ratios of a few tenths to ~2: some tokens and some sequences fall outside [0.5, 5].
    rollout = batch.logp_BT - 0.8 * torch.randn_like(batch.logp_BT)
    got = mismatch_weights(name, old_logp_BT=old, rollout_logp_BT=rollout, mask_BT=batch.mask_BT)
    want = _reference_weights(name, batch.logp_BT, rollout, batch.mask_BT, 0.5, 5.0)
    torch.testing.assert_close(got, torch.tensor(want))
    assert not got.requires_grad


def test_seq_mask_tis_by_hand_clamps_token_ratio_unlike_openrlhf() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    rollout = torch.zeros(2, 4)
    # Row 0: log-ratios 3, -.5, -.5, -.5 -> rho_seq e^0.375 (kept); token 0 has rho e^3 ~ 20.
    # Row 1: log-ratios 2, 2 -> rho_seq e^2 ~ 7.4 > 5, whole sequence dropped.
    old = torch.tensor([[3.0, -0.5, -0.5, -0.5], [2.0, 2.0, 0.0, 0.0]])
    got = mismatch_weights("seq-mask-tis", old_logp_BT=old, rollout_logp_BT=rollout, mask_BT=mask)
    e = math.exp(-0.5)
    torch.testing.assert_close(got, torch.tensor([[5.0, e, e, e], [0.0, 0.0, 0.0, 0.0]]))
    # OpenRLHF 0.11 would weigh token 0 by e^3; icepop drops it; tis clamps it.
    icepop = mismatch_weights("icepop", old_logp_BT=old, rollout_logp_BT=rollout, mask_BT=mask)
    torch.testing.assert_close(icepop[0], torch.tensor([0.0, e, e, e]))


def test_logprob_mismatch_by_hand() -> None:
    old = torch.tensor([[0.0, -1.0, 5.0]])
    rollout = torch.tensor([[0.5, -0.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(logprob_mismatch(old, rollout, mask), torch.tensor(0.5))


def test_error_messages() -> None:
    zeros = torch.zeros(1, 2)
    kwargs = {"old_logp_BT": zeros, "rollout_logp_BT": zeros, "mask_BT": zeros}
    with pytest.raises(ValueError, match="Unknown mismatch correction 'ice_pop'.*'icepop'"):
        mismatch_weights("ice_pop", **kwargs)
    with pytest.raises(ValueError, match="0 <= low <= high; got low=2.0, high=1.0"):
        mismatch_weights("tis", low=2.0, high=1.0, **kwargs)
    with pytest.raises(ValueError, match="must match"):
        mismatch_weights("tis", **{**kwargs, "mask_BT": torch.zeros(2, 2)})
