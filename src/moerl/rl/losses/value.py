"""PPO's clipped value loss (Schulman et al. 2017, as in OpenAI baselines' ppo2).

With V_t the critic's value now, V_old_t its value when the step's advantages were
computed (before the critic trained on the step), R_t the GAE return (the regression
target, rl/gae_returns.py) and eps = rl.critic.value_clip:

    V^clip_t = V_old_t + clip(V_t - V_old_t, -eps, eps)
    L_t      = 1/2 * max((V_t - R_t)^2, (V^clip_t - R_t)^2)
    L        = 1/N * sum_t m_t L_t            N: loss tokens of the global batch

The max keeps the larger error: a value that has moved more than eps from V_old toward
R_t stops being pulled (its clipped error is the larger one and has no gradient), one
that moved away from R_t is still pulled back. eps = None: L_t = 1/2 (V_t - R_t)^2.
The loss is a token mean with the global denominator, so micro-batches and
data-parallel ranks add up to the loss of the whole batch (see aggregation.py).
"""

from __future__ import annotations

import torch

from moerl.rl.losses.aggregation import Denominator, token_share
from moerl.rl.losses.protocol import Metrics


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    clip: float | None,
    denom: Denominator,
) -> tuple[torch.Tensor, Metrics]:
    """This micro-batch's share of L (values carry the gradient; all tensors (B, T)).

    Metrics (additive shares): `value_loss`, and `value_clip_frac`, the fraction of loss
    tokens whose clipped error is the larger (their value gets no gradient)."""
    keep = loss_mask.bool()
    zero = torch.zeros_like(values)
    # Padding may hold anything; where() passes no gradient to the replaced entries.
    v = torch.where(keep, values, zero)
    v_old = torch.where(keep, old_values.detach().to(values.dtype), zero)
    r = torch.where(keep, returns.detach().to(values.dtype), zero)
    error = 0.5 * (v - r) ** 2
    if clip is None:
        per_token, clipped = error, torch.zeros_like(keep)
    else:
        v_clip = v_old + (v - v_old).clamp(-clip, clip)
        error_clip = 0.5 * (v_clip - r) ** 2
        # A selection, not torch.maximum: ties would split the gradient in two.
        clipped = error_clip > error
        per_token = torch.where(clipped, error_clip, error)
    loss = torch.where(keep, per_token, zero).sum() / denom.num_tokens
    metrics = {
        "value_loss": loss.detach(),
        "value_clip_frac": token_share(clipped.to(values.dtype), loss_mask, denom),
    }
    return loss, metrics
