"""GSPO (Zheng et al. 2025): a sequence-level, length-normalised importance ratio.

    s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|) = exp( 1/|y_i| sum_t log r_t )

    L = 1/S sum_i -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

Clipping is per sequence: a sequence whose ratio left the trust region drops out whole,
so one noisy token ratio (common for MoE, whose routing shifts between engine and
trainer) cannot clip or inflate a single token. The token form (GSPO-token) is used,

    s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]

which has the value s_i on every token and, under seq-mean-token-mean aggregation, the
same gradient as the sequence form; it also admits per-token advantages A_{i,t}. The
paper's clip ranges are small (3e-4, 4e-4) because s_i is a geometric mean.
"""

from __future__ import annotations

import torch

from moerl.rl.losses.aggregation import Denominator, masked_max, seq_share
from moerl.rl.losses.ppo_clip import clip_metrics, clipped_surrogate
from moerl.rl.losses.protocol import Metrics, PolicyLossInputs
from moerl.rl.losses.terms import LOG_RATIO_CLAMP, finish_loss, ratio_metrics
from moerl.rl.objective_config import GSPOConfig


def sequence_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """(B,) log s_i = mean over loss tokens of log(pi_theta / pi_old); differentiable."""
    mask = loss_mask.bool()
    diff = torch.where(mask, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    n = mask.sum(dim=-1).clamp(min=1)  # (B,)
    return (diff.sum(dim=-1) / n).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


class GSPO:
    def __init__(self, cfg: GSPOConfig) -> None:
        self.cfg = cfg

    def __call__(
        self, inputs: PolicyLossInputs, denom: Denominator
    ) -> tuple[torch.Tensor, Metrics]:
        inputs = inputs.zero_masked()
        lp, mask = inputs.logprobs, inputs.loss_mask
        seq_log_s = sequence_log_ratio(lp, inputs.old_logprobs, mask)  # (B,)
        # GSPO-token: value s_i everywhere, gradient s_i * d log pi_theta(y_t).
        token_log_s = seq_log_s.detach()[:, None] + lp - lp.detach()  # (B, T)
        s = clipped_surrogate(
            token_log_s.exp(), inputs.token_advantages(), self.cfg.eps_low, self.cfg.eps_high
        )
        token_log_r = (lp - inputs.old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        metrics = ratio_metrics(token_log_r, inputs, denom)
        seq_ratio = seq_log_s.detach().exp()
        has_loss = mask.bool().any(dim=-1)
        metrics["seq_ratio_mean"] = seq_share(seq_ratio, mask, denom)
        metrics["seq_ratio_max"] = masked_max(seq_ratio, has_loss)
        metrics.update(clip_metrics(s, mask, denom))
        return finish_loss(s.loss, inputs, denom, self.cfg, metrics)
