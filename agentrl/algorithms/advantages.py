"""Advantage estimators: GAE, REINFORCE(++), RLOO, GRPO, Dr. GRPO, GiGPO.

Shape suffixes: ``_B`` batch (sequences), ``_T`` tokens (time), ``_G`` group (one prompt's
samples). Per-token tensors are ``[B, T]`` float32; ``mask_BT`` is 1.0 on policy-generated
action tokens and 0 on prompt, observation and padding tokens. ``rewards_BT`` holds each
environment step's reward on the last action token of that step (multi-turn keeps one reward
per step); a sequence's scalar score, used by the group baselines, is the sum of its step rewards.

Pipeline of :func:`compute_advantages` (OpenRLHF 0.11 ``experience_maker.py`` semantics, with
the deliberate differences noted below):

1. optional reward clip, before the baseline (OpenRLHF clamps after it, which caps advantages);
2. a group estimator's outcome advantage: the sample's score ``r`` (the sum of its step
   rewards) less the group baseline ``b``, over ``scale``, on every action token of the sample,
   as GRPO and RLOO define it (and as OpenRLHF gets by summing step rewards onto the last
   token). Not the per-step rewards-to-go less ``b`` (what this did before): unbiased too,
   but in a nearly solved group (scores 1, 1, 1, 2/3 over three turns) it gives every correct
   last turn (1/3 - 0.92) / 0.17 = -3.5, so with 4 samples a group mostly pushes its sampled,
   correct actions down, and an all-solved group's later turns got (2/3 - 1) / 1e-9;
3. KL reward shaping ``r_t -= kl_coef * kl_t`` on every action token;
4. returns ``G_t = r_t + gamma * G_next`` (advantages = returns), or GAE with the critic;
5. optional token-weighted whitening over all action tokens of the batch.

Episodes in segments (``episode_ids_B``: rows with one id are the segments of one episode, in
row order; a chat template that rewrote history split it, ``agentrl.segments``) are estimated
as one sequence each, their rows laid end to end (``agentrl.algorithms.episode_layout``): a
group baseline counts the episode once, and every segment's action tokens get the episode's
outcome advantage (returns and GAE run on across the segments' action tokens).

Discounting walks action tokens only: observation tokens are the environment's transition
between two policy turns, so they neither discount (gamma, lambda) nor bootstrap (values).
This differs from OpenRLHF, which decays gamma and lambda over observation tokens too.
With gamma = lambda = 1 or single-turn data the two agree.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from agentrl.algorithms._common import group_index, group_sum, lookup, masked_mean, register
from agentrl.algorithms.episode_layout import (
    episode_group_ids,
    episode_layout,
    from_episodes,
    to_episodes,
)
from agentrl.algorithms.gigpo import step_advantages, turn_advantages

AdvantageEstimator = Callable[..., tuple[Tensor, Tensor]]
"""Called with keywords ``rewards_BT, mask_BT, group_ids_B, values_BT, gamma, lam,
penalty_BT, state_ids_BT, step_weight, step_gamma`` (rewards already masked; ``penalty_BT =
kl_coef * kl_BT`` on action tokens, to be subtracted after the baseline; the last three are
GiGPO's, see :mod:`agentrl.algorithms.gigpo`); returns un-whitened ``(advantages_BT,
returns_BT)``."""

GROUP_NORM_EPS = 1e-9
WHITEN_EPS = 1e-8


def masked_whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, *, scale_std: bool = True
) -> Tensor:
    """Token-weighted whitening ``(x - mu) / sqrt(max(var, 1e-8))`` over ``mask != 0``.

    ``mu`` and the (population) ``var`` are taken over every selected token of the whole
    tensor, as OpenRLHF does for REINFORCE++. ``shift_mean=False`` skips the mean subtraction
    (``x / std``); ``scale_std=False`` skips the division (``x - mu``). Masked-out entries are 0.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = x - mean if shift_mean else x
    if scale_std:
        out = out * torch.rsqrt(var.clamp_min(WHITEN_EPS))
    return torch.where(mask != 0, out, torch.zeros_like(out))


def last_action_token(mask_BT: Tensor) -> Tensor:
    """Bool ``[B, T]``: True on the last action token of each sequence (none if it has none)."""
    action_BT = mask_BT != 0
    actions_from_here_BT = action_BT.int().flip(1).cumsum(1).flip(1)
    return action_BT & (actions_from_here_BT == 1)


def discounted_returns(rewards_BT: Tensor, mask_BT: Tensor, gamma: float) -> Tensor:
    """Returns ``G_t = r_t + gamma * G_next`` over action tokens; 0 on other tokens.

    ``G_next`` is the return at the next *action* token of the same sequence (0 after the last),
    so observation tokens between turns do not discount. Shapes: ``[B, T] -> [B, T]``.
    """
    action_BT = mask_BT != 0
    rewards_BT = torch.where(action_BT, rewards_BT, torch.zeros_like(rewards_BT))
    if gamma == 1.0:
        returns_BT = rewards_BT.flip(1).cumsum(1).flip(1)
        return torch.where(action_BT, returns_BT, torch.zeros_like(returns_BT))
    returns_BT = torch.zeros_like(rewards_BT)
    next_return_B = torch.zeros_like(rewards_BT[:, 0])
    for t in reversed(range(rewards_BT.shape[1])):
        g_B = rewards_BT[:, t] + gamma * next_return_B
        returns_BT[:, t] = torch.where(action_BT[:, t], g_B, 0.0)
        next_return_B = torch.where(action_BT[:, t], g_B, next_return_B)
    return returns_BT


def gae_advantages(
    rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``,
    ``returns_t = A_t + V_t``, where ``next`` is the next action token of the sequence
    (``V = A = 0`` after the last one). Observation tokens are skipped: the value at the
    first action token of the next turn, which has seen the observation, bootstraps the
    current turn. Shapes: ``[B, T]`` each; returns ``(advantages_BT, returns_BT)``, 0 off-mask.
    """
    action_BT = mask_BT != 0
    advantages_BT = torch.zeros_like(rewards_BT)
    next_value_B = torch.zeros_like(rewards_BT[:, 0])
    next_adv_B = torch.zeros_like(next_value_B)
    for t in reversed(range(rewards_BT.shape[1])):
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        is_action_B = action_BT[:, t]
        advantages_BT[:, t] = torch.where(is_action_B, adv_B, 0.0)
        next_adv_B = torch.where(is_action_B, adv_B, next_adv_B)
        next_value_B = torch.where(is_action_B, values_BT[:, t], next_value_B)
    returns_BT = torch.where(action_BT, advantages_BT + values_BT, torch.zeros_like(values_BT))
    return advantages_BT, returns_BT


def _warn_ignored(estimator: str, **ignored: bool) -> None:
    for option, was_set in ignored.items():
        if was_set:
            warnings.warn(f"{option} is ignored by the {estimator!r} estimator.", stacklevel=4)


def _gae(*, rewards_BT: Tensor, mask_BT: Tensor, values_BT: Tensor | None, gamma: float,
         lam: float, penalty_BT: Tensor, **_: object) -> tuple[Tensor, Tensor]:
    if values_BT is None:
        raise ValueError("The 'gae' estimator needs critic values: pass values_BT=[B, T].")
    return gae_advantages(rewards_BT - penalty_BT, values_BT.float(), mask_BT, gamma, lam)


def _reinforce(*, rewards_BT: Tensor, mask_BT: Tensor, values_BT: Tensor | None, gamma: float,
               lam: float, penalty_BT: Tensor, **_: object) -> tuple[Tensor, Tensor]:
    _warn_ignored("reinforce", lam=lam != 1.0, values_BT=values_BT is not None)
    returns_BT = discounted_returns(rewards_BT - penalty_BT, mask_BT, gamma)
    return returns_BT, returns_BT


def _group_scores(
    estimator: str, rewards_BT: Tensor, group_ids_B: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Scalar scores ``[B]`` (float64), group index ``[B]`` and group sizes ``[G]``; validated."""
    if group_ids_B is None:
        raise ValueError(
            f"The {estimator!r} estimator compares samples of the same prompt: pass "
            "group_ids_B=[B] (equal ids for samples of one prompt)."
        )
    if group_ids_B.shape != rewards_BT.shape[:1]:
        raise ValueError(
            f"group_ids_B must have shape [{rewards_BT.shape[0]}]; got {tuple(group_ids_B.shape)}."
        )
    unique_G, index_B, counts_G = group_index(group_ids_B)
    if bool((counts_G < 2).any()):
        lone = unique_G[counts_G < 2][:5].tolist()
        raise ValueError(
            f"The {estimator!r} estimator needs at least 2 samples per group; groups {lone} "
            "have 1. Sample n > 1 responses per prompt, or use 'reinforce' or 'gae'."
        )
    return rewards_BT.double().sum(1), index_B, counts_G


def _group_baseline(
    scores_B: Tensor, index_B: Tensor, counts_G: Tensor, leave_one_out: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample baseline (group mean or leave-one-out mean), unbiased group std, and whether
    the sample's group scored all equal, ``[B]``."""
    num_groups = counts_G.numel()
    n_G = counts_G.to(scores_B.dtype)
    sum_G = group_sum(scores_B, index_B, num_groups)
    mean_B = (sum_G / n_G)[index_B]
    std_B = (group_sum((scores_B - mean_B) ** 2, index_B, num_groups) / (n_G - 1)).sqrt()[index_B]
    baseline_B = (sum_G[index_B] - scores_B) / (n_G[index_B] - 1) if leave_one_out else mean_B
    max_G = torch.full_like(sum_G, -torch.inf).scatter_reduce(0, index_B, scores_B, "amax")
    min_G = torch.full_like(sum_G, torch.inf).scatter_reduce(0, index_B, scores_B, "amin")
    constant_B = (max_G == min_G)[index_B]
    return baseline_B, std_B, constant_B


def _group_estimator(estimator: str, leave_one_out: bool, divide_std: bool) -> AdvantageEstimator:
    """Build an outcome-baseline estimator; gamma is forced to 1 as in OpenRLHF."""

    def estimate(*, rewards_BT: Tensor, mask_BT: Tensor, group_ids_B: Tensor | None,
                 values_BT: Tensor | None, gamma: float, lam: float, penalty_BT: Tensor,
                 **_: object) -> tuple[Tensor, Tensor]:
        if gamma != 1.0:
            warnings.warn(
                f"The {estimator!r} estimator uses gamma=1 (outcome baseline); gamma={gamma} "
                "is ignored.", stacklevel=3,
            )
        _warn_ignored(estimator, lam=lam != 1.0, values_BT=values_BT is not None)
        scores_B, index_B, counts_G = _group_scores(estimator, rewards_BT, group_ids_B)
        baseline_B, std_B, constant_B = _group_baseline(
            scores_B, index_B, counts_G, leave_one_out)
        scale_B = std_B + GROUP_NORM_EPS if divide_std else torch.ones_like(std_B)
        # The outcome advantage (r - b) / scale on the last action token; with gamma = 1 the
        # returns carry it to every action token of the sample (module docstring, step 2).
        outcome_B = (scores_B - baseline_B) / scale_B
        # A group whose samples all scored the same carries no signal: exactly zero, not the
        # float round-off of its mean divided by std + 1e-9.
        outcome_B = torch.where(constant_B, 0.0, outcome_B)
        shaped_BT = last_action_token(mask_BT) * outcome_B[:, None]
        returns_BT = discounted_returns(shaped_BT.float() - penalty_BT, mask_BT, 1.0)
        return returns_BT, returns_BT

    estimate.__name__ = f"_{estimator}"
    estimate.__doc__ = f"The {estimator!r} advantage estimator (see the module table)."
    return estimate


_group_norm = _group_estimator("group_norm", False, True)


def _gigpo(*, rewards_BT: Tensor, mask_BT: Tensor, group_ids_B: Tensor | None,
           values_BT: Tensor | None, gamma: float, lam: float, penalty_BT: Tensor,
           state_ids_BT: Tensor | None = None, step_weight: float = 1.0,
           step_gamma: float = 0.95, **_: object) -> tuple[Tensor, Tensor]:
    """GiGPO (Feng et al. 2025, arXiv:2505.10978): ``A = A^E + step_weight * A^S`` on every
    action token, ``A^E`` the ``group_norm`` episode advantage (KL penalty included) and
    ``A^S`` the step advantage within anchor-state groups (:mod:`agentrl.algorithms.gigpo`).
    The returns are ``A^E``'s."""
    if state_ids_BT is None:
        raise ValueError(
            "The 'gigpo' estimator groups steps by the state they acted from: pass "
            "state_ids_BT=[B, T] (on the last action token of each step a non-zero id of its "
            "state, 0 elsewhere), or use 'group_norm'."
        )
    episode_BT, returns_BT = _group_norm(
        rewards_BT=rewards_BT, mask_BT=mask_BT, group_ids_B=group_ids_B, values_BT=values_BT,
        gamma=gamma, lam=lam, penalty_BT=penalty_BT)
    if step_weight == 0.0:
        return episode_BT, returns_BT
    assert group_ids_B is not None  # _group_norm raised otherwise
    step_BT = step_advantages(rewards_BT, mask_BT, state_ids_BT, group_ids_B, gamma=step_gamma)
    return episode_BT + step_weight * step_BT, returns_BT


def _rtg_turn(*, rewards_BT: Tensor, mask_BT: Tensor, group_ids_B: Tensor | None,
              values_BT: Tensor | None, gamma: float, lam: float, penalty_BT: Tensor,
              state_ids_BT: Tensor | None = None, **_: object) -> tuple[Tensor, Tensor]:
    """Reward-to-go with a per-turn baseline: turn t's return from t on (``gamma``-discounted
    per turn) against the same turn of the group's other episodes, normalised by their std
    (:func:`agentrl.algorithms.gigpo.turn_advantages`); the KL penalty's reward-to-go is
    subtracted after the baseline. The returns are the advantages."""
    if state_ids_BT is None:
        raise ValueError(
            "The 'rtg_turn' estimator compares each turn with the same turn of the group's "
            "other episodes: pass state_ids_BT=[B, T] (non-zero on the last action token of "
            "each turn, 0 elsewhere), or use 'group_norm'.")
    _warn_ignored("rtg_turn", lam=lam != 1.0, values_BT=values_BT is not None)
    _group_scores("rtg_turn", rewards_BT, group_ids_B)  # validates the groups
    assert group_ids_B is not None
    adv_BT = turn_advantages(rewards_BT, mask_BT, state_ids_BT, group_ids_B, gamma=gamma)
    adv_BT = adv_BT.float() - discounted_returns(penalty_BT, mask_BT, 1.0)
    return adv_BT, adv_BT


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": _gae,
    "reinforce": _reinforce,
    "reinforce_baseline": _group_estimator("reinforce_baseline", False, False),
    "group_norm": _group_norm,
    "dr_grpo": _group_estimator("dr_grpo", False, False),
    "rloo": _group_estimator("rloo", True, False),
    "gigpo": _gigpo,
    "rtg_turn": _rtg_turn,
}
"""Estimators by user-facing name. Baselines (algorithms.md): ``rloo`` r_i - mean_{j!=i} r_j;
``reinforce_baseline`` r_i - mean(r); ``dr_grpo`` r_i - mean(r) (Liu et al. 2025,
arXiv:2503.20783); ``group_norm`` (r_i - mean(r)) / (std_unbiased(r) + 1e-9) (GRPO, Shao et al.
2024, arXiv:2402.03300); ``gigpo`` group_norm's plus step_weight * (G_t - mean_{s~}(G)) /
(std_{s~}(G) + 1e-9) over the steps of the group taken from the same anchor state s~, G_t the
step_gamma-discounted return from step t (Feng et al. 2025, arXiv:2505.10978); ``rtg_turn``
(G_t - mean_g(G_t)) / (std_g(G_t) + 1e-9) on each turn t, G_t its reward-to-go, over the
group's episodes' turn t; ``reinforce``
none (REINFORCE++, Hu 2025, arXiv:2501.03262); ``gae`` a critic."""

_WHITEN_BY_DEFAULT: dict[str, bool] = {"gae": True, "reinforce": True, "reinforce_baseline": True}


def register_advantage_estimator(
    name: str, fn: AdvantageEstimator, *, whiten_by_default: bool = False, overwrite: bool = False
) -> None:
    """Make ``fn`` available as ``compute_advantages(name, ...)``.

    ``fn`` is called with the keywords documented on :data:`AdvantageEstimator` and returns
    un-whitened ``(advantages_BT, returns_BT)``; ``whiten_by_default`` is what ``whiten=None``
    means for it. Raises ``ValueError`` if ``name`` is taken and ``overwrite`` is False.
    """
    register(ADVANTAGE_ESTIMATORS, name, fn, "advantage estimator", overwrite)
    _WHITEN_BY_DEFAULT[name] = whiten_by_default


def _check_shapes(mask_BT: Tensor, **tensors: Tensor | None) -> None:
    if mask_BT.dim() != 2:
        raise ValueError(f"mask_BT must be 2-D [B, T]; got shape {tuple(mask_BT.shape)}.")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != mask_BT.shape:
            raise ValueError(
                f"{name} must have the shape of mask_BT {tuple(mask_BT.shape)}; "
                f"got {tuple(tensor.shape)}."
            )


def compute_advantages(
    estimator: str,
    *,
    rewards_BT: Tensor,
    mask_BT: Tensor,
    group_ids_B: Tensor | None = None,
    values_BT: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool | None = None,
    whiten_std: bool = True,
    kl_BT: Tensor | None = None,
    kl_coef: float = 0.0,
    reward_clip: float | None = None,
    episode_ids_B: Tensor | None = None,
    state_ids_BT: Tensor | None = None,
    step_weight: float = 1.0,
    step_gamma: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns ``([B, T], [B, T])`` for the named estimator (no gradient).

    ``whiten=None`` uses the estimator's default (on for ``reinforce``, ``reinforce_baseline``
    and ``gae``); whitening is :func:`masked_whiten` over all action tokens, and
    ``whiten_std=False`` keeps only its mean subtraction. ``kl_BT`` (e.g. from
    :func:`agentrl.algorithms.kl.kl_estimate`) is subtracted as ``kl_coef * kl_t`` on every
    action token after the baseline. ``reward_clip`` clamps each step reward to
    ``[-reward_clip, reward_clip]`` before the baseline. A non-zero reward off ``mask_BT`` is a
    ``ValueError`` (it would otherwise be silently lost). Both outputs are 0 off ``mask_BT``.
    ``episode_ids_B``: rows with equal ids are segments of one episode, in row order, and are
    estimated as one sequence (module docstring); None: every row is an episode.
    ``state_ids_BT``, ``step_weight``, ``step_gamma``: GiGPO's anchor states (int64, on the last
    action token of each step a non-zero id of the state it acted from), omega and the step
    returns' discount (:mod:`agentrl.algorithms.gigpo`); the other estimators ignore them.
    """
    fn = lookup(ADVANTAGE_ESTIMATORS, estimator, "advantage estimator")
    _check_shapes(mask_BT, rewards_BT=rewards_BT, values_BT=values_BT, kl_BT=kl_BT,
                  state_ids_BT=state_ids_BT)
    with torch.no_grad():
        mask_BT = mask_BT.float()
        action_BT = mask_BT != 0
        if bool((rewards_BT.ne(0) & ~action_BT).any()):
            raise ValueError(
                "rewards_BT is non-zero on tokens where mask_BT is 0; put each step's reward on "
                "the last action token of that step."
            )
        rewards_BT = torch.where(action_BT, rewards_BT.float(), 0.0)
        if reward_clip is not None:
            rewards_BT = rewards_BT.clamp(-reward_clip, reward_clip)
        penalty_BT = torch.zeros_like(rewards_BT)
        if kl_coef != 0.0:
            if kl_BT is None:
                raise ValueError(f"kl_coef={kl_coef} needs kl_BT=[B, T]; pass it or set 0.")
            penalty_BT = torch.where(action_BT, kl_coef * kl_BT.float(), 0.0)
        inputs: dict[str, Tensor | None] = {
            "rewards_BT": rewards_BT, "mask_BT": mask_BT, "group_ids_B": group_ids_B,
            "values_BT": values_BT, "penalty_BT": penalty_BT, "state_ids_BT": state_ids_BT}
        lay_back: Callable[[Tensor], Tensor] | None = None
        if episode_ids_B is not None:
            inputs, lay_back = _by_episode(episode_ids_B, **inputs)
        advantages_BT, returns_BT = fn(**inputs, gamma=gamma, lam=lam, step_weight=step_weight,
                                       step_gamma=step_gamma)
        if lay_back is not None:
            advantages_BT, returns_BT = lay_back(advantages_BT), lay_back(returns_BT)
        if whiten is None:
            whiten = _WHITEN_BY_DEFAULT.get(estimator, False)
        if whiten:  # over the same action tokens in either layout
            advantages_BT = masked_whiten(advantages_BT, mask_BT, scale_std=whiten_std)
        zeros_BT = torch.zeros_like(advantages_BT)
        return torch.where(action_BT, advantages_BT, zeros_BT), torch.where(
            action_BT, returns_BT, zeros_BT
        )


def _by_episode(
    episode_ids_B: Tensor, *, rewards_BT: Tensor | None, mask_BT: Tensor | None,
    group_ids_B: Tensor | None, values_BT: Tensor | None, penalty_BT: Tensor | None,
    state_ids_BT: Tensor | None,
) -> tuple[dict[str, Tensor | None], Callable[[Tensor], Tensor]]:
    """An estimator's inputs with each episode's rows laid end to end (its group, the group of
    its rows), and the function that lays an output back as rows."""
    assert rewards_BT is not None and mask_BT is not None and penalty_BT is not None
    if episode_ids_B.shape != mask_BT.shape[:1]:
        raise ValueError(f"episode_ids_B must have shape [{mask_BT.shape[0]}]; got "
                         f"{tuple(episode_ids_B.shape)}.")
    index_B, position_B, E, S = episode_layout(episode_ids_B.to(mask_BT.device))

    def lay(x_BT: Tensor) -> Tensor:
        return to_episodes(x_BT, index_B, position_B, E, S)

    laid: dict[str, Tensor | None] = {
        "rewards_BT": lay(rewards_BT), "mask_BT": lay(mask_BT), "penalty_BT": lay(penalty_BT),
        "group_ids_B": None if group_ids_B is None else episode_group_ids(
            group_ids_B.to(mask_BT.device), index_B, E),
        "values_BT": None if values_BT is None else lay(values_BT.float()),
        "state_ids_BT": None if state_ids_BT is None else lay(state_ids_BT.long()),
    }
    return laid, lambda x_ET: from_episodes(x_ET, index_B, position_B, S)
