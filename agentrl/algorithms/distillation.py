"""On-policy distillation: the teacher's per-token judgement of the student's own samples as the
advantage (Agarwal et al. 2024, GKD, arXiv:2306.13649; Lu & Thinking Machines 2025, "On-Policy
Distillation", https://thinkingmachines.ai/blog/on-policy-distillation/).

Shape suffixes: ``_B`` batch (sequences), ``_T`` tokens. On a token ``a_t`` the student sampled,
``log pi_teacher(a_t) - log pi_student(a_t)`` is the negative of the k1 estimate of the reverse
KL(pi_student || pi_teacher) at that token, so the policy gradient with it as the advantage
descends the reverse KL. Each token is judged on its own (a discount of zero, as in the blog
post): no returns are summed, no baseline is subtracted, nothing is whitened.
"""

from __future__ import annotations

import torch
from torch import Tensor


def distillation_advantages(
    teacher_logp_BT: Tensor,
    student_logp_BT: Tensor,
    mask_BT: Tensor,
    *,
    env_advantages_BT: Tensor | None = None,
    teacher_coef: float = 1.0,
) -> Tensor:
    """``A_t = c (log pi_T(a_t) - log pi_S(a_t)) + (1 - c) A^env_t`` on action tokens, 0 elsewhere.

    ``c = teacher_coef`` in (0, 1]: 1 is pure distillation; below 1 the env reward's advantage
    (``env_advantages_BT``, from any estimator, needed then) is mixed in. All ``[B, T]``; float32,
    no gradient.
    """
    if not 0.0 < teacher_coef <= 1.0:
        raise ValueError(f"teacher_coef must be in (0, 1], got {teacher_coef}")
    for name, t in (("student_logp_BT", student_logp_BT), ("env_advantages_BT", env_advantages_BT)):
        if t is not None and t.shape != teacher_logp_BT.shape:
            raise ValueError(f"{name} must have the shape of teacher_logp_BT "
                             f"{tuple(teacher_logp_BT.shape)}; got {tuple(t.shape)}")
    if teacher_coef < 1.0 and env_advantages_BT is None:
        raise ValueError(f"teacher_coef={teacher_coef} mixes in the env's advantages: pass "
                         f"env_advantages_BT=[B, T] (or teacher_coef=1)")
    with torch.no_grad():
        adv_BT = teacher_coef * (teacher_logp_BT.float() - student_logp_BT.float())
        if teacher_coef < 1.0:
            assert env_advantages_BT is not None
            adv_BT = adv_BT + (1.0 - teacher_coef) * env_advantages_BT.float()
        return torch.where(mask_BT != 0, adv_BT, torch.zeros_like(adv_BT))
