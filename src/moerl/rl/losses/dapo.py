"""DAPO (Yu et al. 2025): decoupled clip ("clip-higher") and token-level aggregation.

    L = 1/N sum_{i,t} -min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i)

    r_t = pi_theta(y_t) / pi_old(y_t),   N = loss tokens in the whole global batch

eps_high > eps_low leaves more room to raise the probability of unlikely tokens, which
keeps entropy from collapsing; the token-level mean weights every token the same
whatever the length of its sequence. No KL term. DAPO's other two parts live in
advantages.py: dynamic sampling (drop groups whose rewards are all equal) and overlong
reward shaping. Clip fractions are reported separately for the low and high side.
"""

from __future__ import annotations

from moerl.rl.losses.ppo_clip import PPOClip
from moerl.rl.objective_config import DAPOConfig


class DAPO(PPOClip):
    def __init__(self, cfg: DAPOConfig) -> None:
        super().__init__(cfg)
