"""PPO-clip (Schulman et al. 2017), with optional dual clip (Ye et al. 2020).

With r_t = pi_theta(y_t) / pi_old(y_t) and advantage A_t, the per-token loss is

    L_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)

i.e. the ratio stops pulling once it has moved past the trust region in the direction
the advantage favours: clipped tokens (A_t > 0 and r_t > 1 + eps_high, or A_t < 0 and
r_t < 1 - eps_low) contribute a constant and no gradient. Dual clip bounds the loss of
negative-advantage tokens whose ratio has grown very large (c > 1):

    L_t = min(L_t, -c A_t)        for A_t < 0

The per-token loss is then aggregated (token-mean by default) with the global
denominator; KL, entropy and IS correction come from terms.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.rl.losses.aggregation import Denominator, token_share
from moerl.rl.losses.protocol import Metrics, PolicyLossInputs
from moerl.rl.losses.terms import finish_loss, log_ratio, ratio_metrics
from moerl.rl.objective_config import PPOClipConfig


@dataclass(frozen=True)
class ClippedSurrogate:
    """Per-token loss and where each clip was active, all (B, T)."""

    loss: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    clipped_dual: torch.Tensor


def clipped_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> ClippedSurrogate:
    """-min(r A, clip(r) A) per token (ratio, adv: (B, T)), written with explicit masks.

    Written as a selection rather than torch.minimum so that the gradient is exactly
    -A r on active tokens and exactly zero on clipped ones (torch.minimum splits the
    gradient at ties), and the clip masks used for the metrics are the same ones.
    """
    clipped_high = (adv > 0) & (ratio > 1.0 + eps_high)
    clipped_low = (adv < 0) & (ratio < 1.0 - eps_low)
    bound = torch.where(clipped_high, 1.0 + eps_high, 1.0 - eps_low)
    clipped = clipped_high | clipped_low
    loss = torch.where(clipped, -bound * adv, -ratio * adv)
    if dual_clip is not None:
        clipped_dual = (adv < 0) & (ratio > dual_clip)
        loss = torch.where(clipped_dual, -dual_clip * adv, loss)
    else:
        clipped_dual = torch.zeros_like(clipped)
    return ClippedSurrogate(loss, clipped_low, clipped_high, clipped_dual)


def clip_metrics(s: ClippedSurrogate, loss_mask: torch.Tensor, denom: Denominator) -> Metrics:
    f = s.loss.dtype
    return {
        "clip_frac": token_share((s.clipped_low | s.clipped_high).to(f), loss_mask, denom),
        "clip_frac_low": token_share(s.clipped_low.to(f), loss_mask, denom),
        "clip_frac_high": token_share(s.clipped_high.to(f), loss_mask, denom),
        "clip_frac_dual": token_share(s.clipped_dual.to(f), loss_mask, denom),
    }


class PPOClip:
    """The PPO clipped surrogate; GRPO, DAPO and Dr.GRPO are this with other settings."""

    def __init__(self, cfg: PPOClipConfig) -> None:
        self.cfg = cfg

    def __call__(
        self, inputs: PolicyLossInputs, denom: Denominator
    ) -> tuple[torch.Tensor, Metrics]:
        inputs = inputs.zero_masked()
        log_r = log_ratio(inputs.logprobs, inputs.old_logprobs)  # (B, T)
        s = clipped_surrogate(
            log_r.exp(),
            inputs.token_advantages(),
            self.cfg.eps_low,
            self.cfg.eps_high,
            self.cfg.dual_clip,
        )
        metrics = ratio_metrics(log_r, inputs, denom)
        metrics.update(clip_metrics(s, inputs.loss_mask, denom))
        return finish_loss(s.loss, inputs, denom, self.cfg, metrics)
