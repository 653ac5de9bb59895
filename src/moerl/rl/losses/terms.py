"""What every objective shares: the terms added to the surrogate.

Given an objective's per-token policy-gradient loss pg_t (B, T), the loss is

    loss = agg(w_t * pg_t) + beta * agg(KL_t) - c * agg(H_t)

with w_t the rollout/trainer IS correction (1 when off), KL_t an estimator of
KL(pi || pi_ref), H_t the entropy, and agg the configured aggregation with the
global-batch denominator (see aggregation.py). The fields that switch these terms on
are those of ObjectiveConfig (rl/objective_config.py).
"""

from __future__ import annotations

import torch

from moerl.rl.losses.aggregation import Denominator, aggregate, masked_max, token_share
from moerl.rl.losses.entropy import entropy_bonus
from moerl.rl.losses.is_correction import is_weights
from moerl.rl.losses.kl import kl_estimate
from moerl.rl.losses.protocol import Metrics, PolicyLossInputs
from moerl.rl.objective_config import ObjectiveConfig

# exp() of a log-ratio beyond this overflows fp32 long before it means anything.
LOG_RATIO_CLAMP = 20.0


def log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """(B, T) log(pi_theta / pi_old), clamped so exp() stays finite."""
    return (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def finish_loss(
    pg_tokens: torch.Tensor,
    inputs: PolicyLossInputs,
    denom: Denominator,
    cfg: ObjectiveConfig,
    metrics: Metrics,
) -> tuple[torch.Tensor, Metrics]:
    """Weight, aggregate and regularise the per-token loss pg_tokens (B, T)."""
    mask, mode = inputs.loss_mask, cfg.aggregation
    if cfg.is_correction is not None:
        if inputs.rollout_logprobs is None:
            raise ValueError("is_correction is configured but rollout_logprobs were not given")
        weights, is_metrics = is_weights(
            inputs.old_logprobs, inputs.rollout_logprobs, mask, cfg.is_correction, denom,
            inputs.token_versions,
        )
        pg_tokens = pg_tokens * weights
        metrics.update(is_metrics)
    pg_loss = aggregate(pg_tokens, mask, mode, denom)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()

    if cfg.kl_coef > 0 and inputs.ref_logprobs is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs")
    if inputs.ref_logprobs is not None:
        kl_tokens = kl_estimate(inputs.logprobs, inputs.ref_logprobs, cfg.kl_estimator)
        kl_term = aggregate(kl_tokens, mask, mode, denom)
        metrics["kl_ref"] = token_share(kl_tokens, mask, denom)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_term
            metrics["kl_loss"] = kl_term.detach()

    if cfg.entropy_coef > 0 and inputs.entropy is None:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} needs per-token entropy")
    if inputs.entropy is not None:
        metrics["entropy"] = token_share(inputs.entropy, mask, denom)
        if cfg.entropy_coef > 0:
            loss = loss + entropy_bonus(inputs.entropy, mask, cfg.entropy_coef, mode, denom)

    metrics["loss"] = loss.detach()
    return loss, metrics


def ratio_metrics(log_r: torch.Tensor, inputs: PolicyLossInputs, denom: Denominator) -> Metrics:
    """Token-level ratio statistics; log_r (B, T) = log(pi_theta / pi_old)."""
    mask = inputs.loss_mask
    lr = log_r.detach()
    ratio = lr.exp()
    return {
        "ratio_mean": token_share(ratio, mask, denom),
        "ratio_max": masked_max(ratio, mask),
        # k3 estimate of KL(pi_old || pi_theta) on tokens sampled from pi_old:
        # (r - 1) - log r with r = pi_theta / pi_old.
        "approx_kl": token_share(torch.expm1(lr) - lr, mask, denom),
    }
