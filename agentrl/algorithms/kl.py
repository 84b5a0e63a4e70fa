"""KL divergence estimators between the policy and a reference model, and the adaptive coefficient.

Shape suffixes: ``_B`` batch (sequences), ``_T`` tokens (time). Estimators follow Schulman,
"Approximating KL divergence" (2020, http://joschu.net/blog/kl-approx.html) with
``log r_t = logp_t - ref_logp_t`` on tokens sampled from the policy:

- ``k1 = log r`` (unbiased, high variance, can be negative);
- ``k2 = (log r)^2 / 2`` (biased, low variance; its gradient is the true KL gradient);
- ``k3 = exp(-log r) - 1 + log r`` (unbiased for KL(pi || ref), always >= 0).

As in OpenRLHF, every estimate is clamped to ``[-10, 10]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from agentrl.algorithms._common import lookup

KL_CLAMP = 10.0
# exp(20) - 21 > 10, so clamping log r to +-20 before the exponential leaves every k3 value
# unchanged after the final clamp, and keeps its gradient finite (exp would overflow to inf).
_LOG_RATIO_CLAMP = 20.0


def _k1(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    return logp_BT - ref_logp_BT


def _k2(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    return 0.5 * (logp_BT - ref_logp_BT) ** 2


def _k3(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    log_ratio_BT = (logp_BT - ref_logp_BT).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.exp(-log_ratio_BT) - 1.0 + log_ratio_BT


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}
"""Un-clamped estimators ``(logp_BT, ref_logp_BT) -> kl_BT``; use :func:`kl_estimate`."""


def kl_estimate(name: str, logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    """Per-token KL estimate ``[B, T]`` by estimator name, clamped to ``[-10, 10]``.

    Computed in float32. Not masked: multiply by ``mask_BT`` or pass to a masked reduction.
    Differentiable, for use as a loss term (``k2`` or ``k3``) as well as reward shaping.
    """
    fn = lookup(KL_ESTIMATORS, name, "KL estimator")
    if logp_BT.shape != ref_logp_BT.shape:
        raise ValueError(
            f"logp_BT {tuple(logp_BT.shape)} and ref_logp_BT {tuple(ref_logp_BT.shape)} must "
            "have the same shape."
        )
    return fn(logp_BT.float(), ref_logp_BT.float()).clamp(-KL_CLAMP, KL_CLAMP)


def adaptive_kl_coef(
    coef: float, observed_kl: float, *, target: float, horizon: float, n_steps: int
) -> float:
    """One update of the adaptive KL controller (Ziegler et al. 2019, arXiv:1909.08593, eq. 2).

    ``e = clip(observed_kl / target - 1, -0.2, 0.2)``; ``coef <- coef * (1 + e * n_steps /
    horizon)``, where ``n_steps`` is the number of samples (or steps) since the last update.
    """
    if target <= 0 or horizon <= 0:
        raise ValueError(
            f"adaptive_kl_coef needs target > 0 and horizon > 0; got target={target}, "
            f"horizon={horizon}."
        )
    if n_steps < 0:
        raise ValueError(f"n_steps must be >= 0; got {n_steps}.")
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)
