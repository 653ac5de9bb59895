"""GRPO (Shao et al. 2024, DeepSeekMath): PPO-clip without a value model.

Advantages come from the group of G samples of the same prompt
(advantages.group_normalized: A_i = (R_i - mean_G R) / (std_G R + eps)), broadcast to
every token of sample i. The objective is the clipped surrogate averaged per sequence,
then over sequences, with a k3 KL term to the reference policy in the loss:

    L = 1/S sum_i 1/|y_i| sum_t [ -min(r_t A_i, clip(r_t, 1 - eps, 1 + eps) A_i)
                                  + beta * k3_t ]

    r_t = pi_theta(y_t) / pi_old(y_t),  k3_t = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1
"""

from __future__ import annotations

from moerl.rl.losses.ppo_clip import PPOClip
from moerl.rl.objective_config import GRPOConfig


class GRPO(PPOClip):
    def __init__(self, cfg: GRPOConfig) -> None:
        super().__init__(cfg)
