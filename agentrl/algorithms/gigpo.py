"""GiGPO's step level: advantages of the steps taken from the same anchor state.

Group-in-Group Policy Optimization (Feng et al. 2025, arXiv:2505.10978). A prompt's group of
episodes is compared twice: once as whole episodes (GRPO's episode advantage ``A^E``, the
``group_norm`` estimator) and once step by step. Every step taken from an *anchor state* that
several episodes of the group visited (the same environment state, recognised by equal state
ids) is compared with the other steps taken from it:

    G_t     = sum_{k >= 0} step_gamma^k r_{t+k}          discounted return from step t
    A^S_t   = (G_t - mean_{s~}(G)) / (std_{s~}(G) + 1e-9)  within the anchor group s~
    A_t     = A^E + step_weight * A^S_t                    on every action token of step t

where ``s~`` holds every step of the same group whose state id equals step t's (a state
revisited inside one episode contributes each visit). The paper's defaults are
``step_gamma = 0.95`` and ``step_weight = 1``; ``divide_std=False`` drops the division
(Dr. GRPO style). ``std`` is the unbiased one, as ``group_norm`` uses.

Assumptions and deliberate choices (stated because the paper leaves them open or because
agentrl needs them):

- an anchor group of one step, or one whose returns are all equal, gives ``A^S = 0``;
- the first step of an episode is never an anchor: every episode of a group starts from the
  same reset, so its anchor group would be the episode group itself, and comparing it again
  (with discounted returns) would count the episode-level comparison twice. With this rule,
  GiGPO on episodes whose later states never recur (single-turn tasks, tool outputs that
  differ) is exactly GRPO;
- a step is the tokens of one policy turn; its reward and its state id sit on its last action
  token (``state_ids_BT``, 0 on every other token). Action tokens after a row's last marked
  step belong to no step and get ``A^S = 0``.

Shape suffixes: ``_B`` sequences, ``_T`` tokens, ``_K`` steps of a sequence, ``_A`` anchor
groups. :func:`step_advantages_reference` is the plain-loop reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agentrl.algorithms._common import group_sum

GROUP_NORM_EPS = 1e-9


def token_steps(state_ids_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    """``(step_BT, num_steps_B)``: the step (0-based) each action token belongs to (a step
    ends at a non-zero state id; ``num_steps_B`` for tokens after the last one, and for
    non-action tokens) and the number of steps of each row."""
    ends_BT = (state_ids_BT != 0).long()
    num_steps_B = ends_BT.sum(1)
    step_BT = ends_BT.cumsum(1) - ends_BT  # steps ended strictly before each token
    step_BT = torch.where(mask_BT != 0, step_BT, num_steps_B[:, None])
    return step_BT, num_steps_B


def per_step(x_BT: Tensor, step_BT: Tensor, num_steps: int) -> Tensor:
    """``[B, T] -> [B, K]``: the sum of ``x`` over each step's tokens (tokens of no step,
    ``step_BT >= K``, are dropped)."""
    out_BK = x_BT.new_zeros(x_BT.shape[0], num_steps + 1)
    out_BK.scatter_add_(1, step_BT.clamp(max=num_steps), x_BT)
    return out_BK[:, :num_steps]


def step_returns(rewards_BK: Tensor, num_steps_B: Tensor, gamma: float) -> Tensor:
    """``G_k = r_k + gamma * G_{k+1}`` over each row's steps ``[B, K]``; 0 past its last."""
    K = rewards_BK.shape[1]
    valid_BK = torch.arange(K, device=rewards_BK.device)[None, :] < num_steps_B[:, None]
    returns_BK = torch.zeros_like(rewards_BK)
    next_B = torch.zeros_like(rewards_BK[:, 0]) if K else rewards_BK.new_zeros(0)
    for k in reversed(range(K)):
        g_B = torch.where(valid_BK[:, k], rewards_BK[:, k] + gamma * next_B, 0.0)
        returns_BK[:, k], next_B = g_B, g_B
    return returns_BK


def anchor_groups(
    state_ids_BK: Tensor, group_ids_B: Tensor, num_steps_B: Tensor
) -> tuple[Tensor, int]:
    """``(anchor_BK, num_anchors)``: each step's anchor group (0..A-1: equal prompt group and
    equal state id), -1 for steps that are no anchor candidate (an episode's first step, and
    past its last step)."""
    B, K = state_ids_BK.shape
    k_BK = torch.arange(K, device=state_ids_BK.device)[None, :].expand(B, K)
    candidate_BK = (k_BK >= 1) & (k_BK < num_steps_B[:, None])
    anchor_BK = torch.full_like(state_ids_BK, -1)
    if not bool(candidate_BK.any()):
        return anchor_BK, 0
    keys_N2 = torch.stack([group_ids_B[:, None].expand(B, K)[candidate_BK],
                           state_ids_BK[candidate_BK]], dim=1)
    unique_A2, index_N = torch.unique(keys_N2, dim=0, return_inverse=True)
    anchor_BK[candidate_BK] = index_N
    return anchor_BK, int(unique_A2.shape[0])


def anchor_advantages(
    returns_BK: Tensor, anchor_BK: Tensor, num_anchors: int, divide_std: bool = True
) -> Tensor:
    """``A^S [B, K]``: each step's return less its anchor group's mean, over the group's
    unbiased std + 1e-9 (``divide_std``); 0 for steps of no anchor, of a one-step anchor group,
    or of a group whose returns are all equal."""
    in_BK = anchor_BK >= 0
    if num_anchors == 0:
        return torch.zeros_like(returns_BK)
    index_N, g_N = anchor_BK[in_BK], returns_BK[in_BK].double()
    n_A = group_sum(torch.ones_like(g_N), index_N, num_anchors)
    mean_N = (group_sum(g_N, index_N, num_anchors) / n_A)[index_N]
    var_A = group_sum((g_N - mean_N) ** 2, index_N, num_anchors) / (n_A - 1).clamp_min(1)
    adv_N = g_N - mean_N
    if divide_std:
        adv_N = adv_N / (var_A.sqrt()[index_N] + GROUP_NORM_EPS)
    g_max_A = torch.full_like(n_A, -torch.inf).scatter_reduce(0, index_N, g_N, "amax")
    g_min_A = torch.full_like(n_A, torch.inf).scatter_reduce(0, index_N, g_N, "amin")
    # One member, or all equal: no signal, exactly zero (not round-off over 1e-9).
    silent_N = ((n_A < 2) | (g_max_A == g_min_A))[index_N]
    out_BK = torch.zeros_like(returns_BK)
    out_BK[in_BK] = torch.where(silent_N, 0.0, adv_N).to(returns_BK.dtype)
    return out_BK


def step_advantages(
    rewards_BT: Tensor, mask_BT: Tensor, state_ids_BT: Tensor, group_ids_B: Tensor, *,
    gamma: float = 0.95, divide_std: bool = True,
) -> Tensor:
    """GiGPO's step-level advantage ``A^S`` on every action token ``[B, T]`` (module docstring).

    ``rewards_BT``: each step's reward on its action tokens (summed per step);
    ``state_ids_BT``: int64, on the last action token of each step the id of the state the
    step acted from, 0 elsewhere; ``group_ids_B``: the prompt group of each row.
    """
    if state_ids_BT.shape != mask_BT.shape:
        raise ValueError(f"state_ids_BT must have the shape of mask_BT {tuple(mask_BT.shape)}; "
                         f"got {tuple(state_ids_BT.shape)}.")
    state_ids_BT = torch.where(mask_BT != 0, state_ids_BT.long(), 0)
    step_BT, num_steps_B, rewards_BK = _steps(rewards_BT, mask_BT, state_ids_BT)
    K = rewards_BK.shape[1]
    if K == 0:
        return torch.zeros_like(rewards_BT)
    state_ids_BK = per_step(state_ids_BT, step_BT, K)  # one marked token per step
    anchor_BK, num_anchors = anchor_groups(state_ids_BK, group_ids_B.long(), num_steps_B)
    adv_BK = anchor_advantages(step_returns(rewards_BK, num_steps_B, gamma), anchor_BK,
                               num_anchors, divide_std)
    return _on_tokens(adv_BK, step_BT, rewards_BT.dtype)


def turn_advantages(
    rewards_BT: Tensor, mask_BT: Tensor, step_ends_BT: Tensor, group_ids_B: Tensor, *,
    gamma: float = 1.0,
) -> Tensor:
    """Reward-to-go with a per-turn baseline (the ``rtg_turn`` estimator) on every action
    token ``[B, T]``: the steps of a group are compared by their turn index instead of their
    state, every turn included (the first too),

        A_t = (G_t - mean_g(G_t)) / (std_g(G_t) + 1e-9),   G_t = sum_{k >= 0} gamma^k r_{t+k}

    the mean and unbiased std over the group's episodes' turn t (one episode, or all equal:
    0). ``step_ends_BT``: non-zero on the last action token of each step, 0 elsewhere (the
    trainer passes its state ids, which are never 0)."""
    ends_BT = torch.where(mask_BT != 0, step_ends_BT.long(), 0)
    step_BT, num_steps_B, rewards_BK = _steps(rewards_BT, mask_BT, ends_BT)
    B, K = rewards_BK.shape
    if K == 0:
        return torch.zeros_like(rewards_BT)
    k_BK = torch.arange(K, device=rewards_BK.device)[None, :].expand(B, K)
    valid_BK = k_BK < num_steps_B[:, None]
    keys_BK = torch.where(valid_BK, group_ids_B.long()[:, None] * K + k_BK, -1)
    _, index = torch.unique(keys_BK[valid_BK], return_inverse=True)
    turn_BK = torch.full_like(keys_BK, -1)
    turn_BK[valid_BK] = index
    adv_BK = anchor_advantages(step_returns(rewards_BK, num_steps_B, gamma), turn_BK,
                               int(index.max()) + 1)
    return _on_tokens(adv_BK, step_BT, rewards_BT.dtype)


def _steps(rewards_BT: Tensor, mask_BT: Tensor, ends_BT: Tensor
           ) -> tuple[Tensor, Tensor, Tensor]:
    """``(step_BT, num_steps_B, rewards_BK)`` of the steps that end at the non-zero entries of
    ``ends_BT`` (on action tokens); ``rewards_BK`` in float64, ``K = 0`` without a step."""
    step_BT, num_steps_B = token_steps(ends_BT, mask_BT)
    K = int(num_steps_B.max()) if num_steps_B.numel() else 0
    rewards_BK = per_step(torch.where(mask_BT != 0, rewards_BT.double(), 0.0), step_BT, K)
    return step_BT, num_steps_B, rewards_BK


def _on_tokens(adv_BK: Tensor, step_BT: Tensor, dtype: torch.dtype) -> Tensor:
    """Each step's value on its tokens; 0 on tokens of no step (``step_BT == K``)."""
    adv_BK = torch.cat([adv_BK, adv_BK.new_zeros(adv_BK.shape[0], 1)], dim=1)
    return adv_BK.gather(1, step_BT).to(dtype)


def step_advantages_reference(
    rewards_BT: Tensor, mask_BT: Tensor, state_ids_BT: Tensor, group_ids_B: Tensor, *,
    gamma: float = 0.95, divide_std: bool = True,
) -> Tensor:
    """Plain-loop :func:`step_advantages`: lists of steps per row, a dict of anchor groups."""
    B, T = mask_BT.shape
    steps: list[list[tuple[list[int], float, int]]] = []  # per row: (tokens, reward, state)
    for b in range(B):
        row, tokens, reward = [], [], 0.0
        for t in range(T):
            if mask_BT[b, t] == 0:
                continue
            tokens.append(t)
            reward += float(rewards_BT[b, t])
            if int(state_ids_BT[b, t]) != 0:
                row.append((tokens, reward, int(state_ids_BT[b, t])))
                tokens, reward = [], 0.0
        steps.append(row)
    anchors: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
    for b, row in enumerate(steps):
        g = 0.0
        returns = [0.0] * len(row)
        for k in reversed(range(len(row))):
            g = row[k][1] + gamma * g
            returns[k] = g
        for k in range(1, len(row)):  # the first step is never an anchor
            anchors.setdefault((int(group_ids_B[b]), row[k][2]), []).append((b, k, returns[k]))
    out = torch.zeros(B, T, dtype=torch.float64)
    for members in anchors.values():
        gs = [g for _, _, g in members]
        if len(gs) < 2 or max(gs) == min(gs):
            continue
        mean = sum(gs) / len(gs)
        std = (sum((g - mean) ** 2 for g in gs) / (len(gs) - 1)) ** 0.5
        for b, k, g in members:
            adv = (g - mean) / (std + GROUP_NORM_EPS) if divide_std else g - mean
            out[b, steps[b][k][0]] = adv
    return out.to(rewards_BT.dtype)
