"""Entropy bonus.

Per-token entropy of the policy's next-token distribution p = softmax(z):

    H_t = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v

The bonus is subtracted from the loss: loss -= c * aggregate(H). Under tensor
parallelism the vocabulary is split across ranks, so the policy computes H_t with
vocab-parallel reductions and passes the per-token values (`entropy_bonus`); the
`entropy_from_logits` path is for full-vocabulary logits (one rank, tests).
"""

from __future__ import annotations

import torch

from moerl.rl.losses.aggregation import Denominator, aggregate
from moerl.rl.objective_config import AggregationMode


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits -> (B, T) entropy, in at least fp32 (bf16 logits are upcast)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_p = torch.log_softmax(z, dim=-1)  # (B, T, V)
    p = log_p.exp()
    # Tokens banned with -inf logits have p = 0 and log p = -inf; 0 * -inf is nan, and
    # so would be its gradient, hence log p is replaced by 0 there before the product.
    safe_log_p = torch.where(p > 0, log_p, torch.zeros_like(log_p))
    return -(p * safe_log_p).sum(dim=-1)


def entropy_bonus(
    entropy: torch.Tensor,
    loss_mask: torch.Tensor,
    coef: float,
    mode: AggregationMode,
    denom: Denominator,
) -> torch.Tensor:
    """The term added to the loss: -coef * aggregate(H); entropy (B, T)."""
    return -coef * aggregate(entropy, loss_mask, mode, denom)
