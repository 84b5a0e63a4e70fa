"""RL algorithms as pure functions on tensors: advantages, losses, KL, corrections, shaping.

Shape suffixes: ``_B`` batch (sequences), ``_T`` tokens (time), ``_G`` group, ``_V`` vocab.
Every family is dispatched by a dict keyed by its user-facing name, extensible through a
``register_*`` function.
"""

from agentrl.algorithms._common import masked_mean
from agentrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    masked_whiten,
    register_advantage_estimator,
)
from agentrl.algorithms.corrections import (
    MISMATCH_CORRECTIONS,
    logprob_mismatch,
    mismatch_weights,
)
from agentrl.algorithms.distillation import distillation_advantages
from agentrl.algorithms.kl import KL_ESTIMATORS, adaptive_kl_coef, kl_estimate
from agentrl.algorithms.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    aggregate_loss,
    check_cispo_clip,
    cispo_loss,
    entropy_from_logits,
    gspo_loss,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
    policy_loss,
    ppo_loss,
    register_policy_loss,
    value_loss,
)
from agentrl.algorithms.shaping import (
    FILTER_CRITERIA,
    dynamic_filter,
    overlong_penalty,
    truncation_penalty,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "FILTER_CRITERIA",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "MISMATCH_CORRECTIONS",
    "POLICY_LOSSES",
    "adaptive_kl_coef",
    "aggregate_loss",
    "check_cispo_clip",
    "cispo_loss",
    "compute_advantages",
    "discounted_returns",
    "distillation_advantages",
    "dynamic_filter",
    "entropy_from_logits",
    "gae_advantages",
    "gspo_loss",
    "kl_estimate",
    "logprob_mismatch",
    "logprobs_and_entropy_from_logits",
    "logprobs_from_logits",
    "masked_mean",
    "masked_whiten",
    "mismatch_weights",
    "overlong_penalty",
    "policy_loss",
    "ppo_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "truncation_penalty",
    "value_loss",
]
