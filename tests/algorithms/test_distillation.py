"""On-policy distillation's advantages against a plain loop, by hand, and their refusals."""

from __future__ import annotations

import pytest
import torch

from agentrl.algorithms import compute_advantages, distillation_advantages

from ._batches import make_batch


def _reference(teacher, student, mask, env, coef) -> list[list[float]]:
    out = []
    for b in range(len(mask)):
        row = []
        for t in range(len(mask[b])):
            if mask[b][t] == 0:
                row.append(0.0)
                continue
            a = coef * (float(teacher[b][t]) - float(student[b][t]))
            if coef < 1:
                a += (1 - coef) * float(env[b][t])
            row.append(a)
        out.append(row)
    return out


@pytest.mark.parametrize("coef", [1.0, 0.7, 0.25])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_the_loop_reference(seed: int, coef: float) -> None:
    batch = make_batch(seed)
    teacher = batch.logp_BT + 1.5 * torch.randn_like(batch.logp_BT)
    env, _ = compute_advantages("group_norm", rewards_BT=batch.rewards_BT,
                                mask_BT=batch.mask_BT, group_ids_B=batch.group_ids_B)
    got = distillation_advantages(teacher, batch.logp_BT, batch.mask_BT,
                                  env_advantages_BT=env if coef < 1 else None, teacher_coef=coef)
    want = _reference(teacher, batch.logp_BT, batch.mask_BT, env, coef)
    torch.testing.assert_close(got, torch.tensor(want))
    assert bool((got[batch.mask_BT == 0] == 0).all())


def test_by_hand() -> None:
    """Teacher minus student per token: a token the teacher likes more is pushed up, one it
    likes less down; the env's advantage comes in with weight 1 - c."""
    teacher = torch.tensor([[-0.5, -3.0, -1.0, -9.0]])
    student = torch.tensor([[-0.1, -1.0, -1.0, -2.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    got = distillation_advantages(teacher, student, mask)
    torch.testing.assert_close(got, torch.tensor([[0.0, -2.0, 0.0, -7.0]]))
    env = torch.full((1, 4), 4.0)
    got = distillation_advantages(teacher, student, mask, env_advantages_BT=env, teacher_coef=0.5)
    torch.testing.assert_close(got, torch.tensor([[0.0, 1.0, 2.0, -1.5]]))


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"teacher_coef": 0.0}, r"teacher_coef must be in \(0, 1\], got 0.0"),
        ({"teacher_coef": 1.5}, r"teacher_coef must be in \(0, 1\], got 1.5"),
        ({"teacher_coef": 0.5}, "pass env_advantages_BT"),
        ({"env_advantages_BT": torch.zeros(2, 3)}, "env_advantages_BT must have the shape"),
    ],
)
def test_refusals(kwargs, says) -> None:
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=says):
        distillation_advantages(x, x, x, **kwargs)
