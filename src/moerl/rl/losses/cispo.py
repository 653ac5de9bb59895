"""CISPO (MiniMax-M1, 2025): clip the importance weight, never drop a token's gradient.

    w_t = sg[ clip(r_t, 1 - eps_low, 1 + eps_high) ],   r_t = pi_theta(y_t) / pi_old(y_t)

    L = agg_t( -w_t * A_t * log pi_theta(y_t) )

PPO-clip zeroes the gradient of a token once its ratio leaves the trust region; rare
tokens that matter for reasoning ("wait", "however") tend to do so after the first
update and stop learning. CISPO instead bounds the weight and keeps every token's
REINFORCE gradient -w_t A_t grad log pi_theta. The paper puts no lower bound on the
weight (eps_low = 1 here, i.e. w >= 0) and tunes only eps_high.
"""

from __future__ import annotations

import torch

from moerl.rl.losses.aggregation import Denominator, token_share
from moerl.rl.losses.protocol import Metrics, PolicyLossInputs
from moerl.rl.losses.terms import finish_loss, log_ratio, ratio_metrics
from moerl.rl.objective_config import CISPOConfig


class CISPO:
    def __init__(self, cfg: CISPOConfig) -> None:
        self.cfg = cfg

    def __call__(
        self, inputs: PolicyLossInputs, denom: Denominator
    ) -> tuple[torch.Tensor, Metrics]:
        inputs = inputs.zero_masked()
        log_r = log_ratio(inputs.logprobs, inputs.old_logprobs)  # (B, T)
        ratio = log_r.detach().exp()
        lo, hi = 1.0 - self.cfg.eps_low, 1.0 + self.cfg.eps_high
        weight = ratio.clamp(lo, hi)  # (B, T), no gradient: built from a detached ratio
        adv = inputs.token_advantages()
        pg_tokens = -weight * adv * inputs.logprobs

        mask, f = inputs.loss_mask, ratio.dtype
        metrics = ratio_metrics(log_r, inputs, denom)
        metrics["clip_frac_low"] = token_share((ratio < lo).to(f), mask, denom)
        metrics["clip_frac_high"] = token_share((ratio > hi).to(f), mask, denom)
        metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
        metrics["cispo_weight_mean"] = token_share(weight, mask, denom)
        return finish_loss(pg_tokens, inputs, denom, self.cfg, metrics)
