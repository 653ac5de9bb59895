"""Correction for the gap between the rollout engine's logprobs and the trainer's.

The engine (vLLM, SGLang, Megatron inference; other kernels, other precision, maybe an
older weight version) samples from pi_rollout, while the loss is written for pi_old,
the trainer's policy at the start of the step. The per-token importance ratio

    rho_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_logprobs - rollout_logprobs)

re-weights each token's policy-gradient term. Levels:

    token      w_t = rho_t
    sequence   w_t = prod_{s in y_i} rho_s        (the same for every token of sequence i)
    geometric  w_t = exp(mean_{s in y_i} log rho_s)   (length-normalised sequence ratio)

Modes:

    TIS (truncated IS)  w <- min(w, upper)
    MIS (masked IS)     w <- w * 1[lower <= w <= upper]: out-of-range tokens (or whole
                        sequences) are dropped from the gradient instead of truncated.

Weights carry no gradient. Dropped tokens keep their place in the global denominator,
so gradient accumulation stays exact; they simply contribute zero.

With partial rollouts a weight update can land during a generation: its tokens then
come from two versions, each with the rollout logprob of the version that sampled it,
so rho_t corrects each token against its own sampler. Given the per-token versions, the
metrics say how many versions sampled a sequence (`is/versions_per_seq_max`) and what
share of tokens an older version than the last of its sequence sampled
(`is/older_version_frac`).
"""

from __future__ import annotations

import torch

from moerl.rl.losses.aggregation import Denominator, masked_max, token_share
from moerl.rl.objective_config import ISCorrectionConfig, ISLevel, ISMode


def is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: ISCorrectionConfig,
    denom: Denominator,
    token_versions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token IS weights (B, T), detached, zero on masked tokens; and their metrics.

    old_logprobs, rollout_logprobs, loss_mask: (B, T); token_versions: (B, T) int64.
    """
    with torch.no_grad():
        mask = loss_mask.bool()
        log_rho = torch.where(mask, old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs))
        if cfg.level is ISLevel.TOKEN:
            log_w = log_rho
        else:
            seq_log = log_rho.sum(dim=-1, keepdim=True)  # (B, 1)
            if cfg.level is ISLevel.GEOMETRIC:
                seq_log = seq_log / mask.sum(dim=-1, keepdim=True).clamp(min=1)
            log_w = seq_log.expand_as(log_rho)
        raw = log_w.clamp(-cfg.log_clamp, cfg.log_clamp).exp()  # (B, T)

        if cfg.mode is ISMode.TRUNCATE:
            corrected = raw.clamp(max=cfg.upper)
            dropped = torch.zeros_like(mask)
            changed = raw > cfg.upper
        else:
            keep = (raw >= cfg.lower) & (raw <= cfg.upper)
            corrected = torch.where(keep, raw, torch.zeros_like(raw))
            dropped = ~keep
            changed = dropped
        weights = torch.where(mask, corrected, torch.zeros_like(corrected))

    metrics = {
        "is/raw_weight_mean": token_share(raw, loss_mask, denom),
        "is/raw_weight_max": masked_max(raw, loss_mask),
        "is/weight_mean": token_share(weights, loss_mask, denom),
        "is/changed_frac": token_share(changed.to(raw.dtype), loss_mask, denom),
        "is/dropped_frac": token_share(dropped.to(raw.dtype), loss_mask, denom),
        # KL(pi_rollout || pi_old) by k3 over sampled tokens: how far apart the two are.
        "is/mismatch_kl": token_share(torch.expm1(log_rho) - log_rho, loss_mask, denom),
    }
    if token_versions is not None:
        metrics.update(version_metrics(token_versions, loss_mask, denom))
    return weights, metrics


def version_metrics(versions: torch.Tensor, loss_mask: torch.Tensor, denom: Denominator
                    ) -> dict[str, torch.Tensor]:
    """Distinct weight versions among each sequence's loss tokens (max over sequences), and
    the share of loss tokens sampled before the last version of their sequence.

    versions (B, T) int64, loss_mask (B, T).
    """
    mask = loss_mask.bool()
    low = torch.iinfo(versions.dtype).min
    own = torch.where(mask, versions, torch.full_like(versions, low))  # (B, T)
    ordered = torch.sort(own, dim=-1).values
    starts = torch.ones_like(ordered[:, :1], dtype=torch.bool)  # (B, 1)
    new = torch.cat([starts, ordered[:, 1:] != ordered[:, :-1]], dim=-1) & (ordered != low)
    per_seq = new.sum(dim=-1).to(torch.float32)  # (B,) versions; 0 for a row without loss
    older = mask & (versions < own.amax(dim=-1, keepdim=True))
    return {"is/versions_per_seq_max": per_seq.max(),
            "is/older_version_frac": token_share(older.to(torch.float32), loss_mask, denom)}
