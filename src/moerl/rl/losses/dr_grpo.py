"""Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): GRPO unbiased.

GRPO divides each sequence's loss by its own length |y_i| (longer wrong answers are
penalised less per token) and each advantage by the group's reward std (questions that
are too easy or too hard weigh more). Dr.GRPO removes both:

    L = 1/(S * L_max) sum_{i,t} -min(r_t A_i, clip(r_t, 1 - eps, 1 + eps) A_i)

    A_i = R_i - mean_G R         (advantages.group_normalized(..., scale_by_std=False))

with S the number of sequences in the global batch and L_max a constant (the maximum
response length), passed as Denominator.norm_len: aggregation seq-mean-token-sum-norm.
"""

from __future__ import annotations

from moerl.rl.losses.ppo_clip import PPOClip
from moerl.rl.objective_config import DrGRPOConfig


class DrGRPO(PPOClip):
    def __init__(self, cfg: DrGRPOConfig) -> None:
        super().__init__(cfg)
