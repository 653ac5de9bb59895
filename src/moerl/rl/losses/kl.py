"""KL divergence to a reference policy, from samples of the current policy.

With log r_t = log pi_ref(y_t) - log pi(y_t), for tokens y_t sampled from pi, the
per-token estimators of KL(pi || pi_ref) (Schulman, "Approximating KL divergence"):

    k1 = -log r                      unbiased, high variance, can be negative
    k2 = (log r)^2 / 2               biased, low variance, >= 0
    k3 = (r - 1) - log r             unbiased, low variance, >= 0 (GRPO's estimator)

Used two ways:
  * as a loss term (`kl_loss`): gradients flow through log pi; aggregated like the
    policy loss and added with coefficient beta.
  * as a reward penalty (`kl_penalty`): detached per-token values, subtracted from the
    per-token reward (beta * k) before advantages are computed (PPO, REINFORCE++).
"""

from __future__ import annotations

import torch

from moerl.rl.losses.aggregation import Denominator, aggregate
from moerl.rl.objective_config import AggregationMode, KLEstimator


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: KLEstimator,
    clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token KL estimate, (B, T) -> (B, T), differentiable in `logprobs`.

    clamp bounds log r before the exponential of k3 (and the value of every estimator)
    so one token whose reference logprob is far off cannot produce inf; None disables it.
    """
    log_r = ref_logprobs.detach() - logprobs  # (B, T)
    if clamp is not None:
        log_r = log_r.clamp(-clamp, clamp)
    if estimator is KLEstimator.K1:
        return -log_r
    if estimator is KLEstimator.K2:
        return 0.5 * log_r.square()
    if estimator is KLEstimator.K3:
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}")


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    estimator: KLEstimator,
    mode: AggregationMode,
    denom: Denominator,
) -> torch.Tensor:
    """Aggregated KL term (this micro-batch's share), to be scaled by beta and added."""
    return aggregate(kl_estimate(logprobs, ref_logprobs, estimator), loss_mask, mode, denom)


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    estimator: KLEstimator = KLEstimator.K1,
) -> torch.Tensor:
    """Per-token KL values for the reward, (B, T), zero on masked tokens, no gradient.

    logprobs here are those the samples were generated with (rollout or recomputed old
    logprobs); the caller subtracts beta * penalty from the per-token rewards.
    """
    with torch.no_grad():
        k = kl_estimate(logprobs, ref_logprobs, estimator)
        return torch.where(loss_mask.bool(), k, torch.zeros_like(k))
