"""Per-token advantages of PPO with a critic (`rl.advantage=gae`), computed in the update.

Once the step's values V_t (the critic's, before it trains on the step) and the reference
logprobs of every micro-batch are known (the loop's `update`, rl/loop.py):

    r_t     = -beta * (log pi_old(t) - log pi_ref(t))   (+ R_i on the last loss token)
    delta_t = r_t + gamma * V_next(t) - V_t
    A_t     = delta_t + gamma * lambda * A_next(t)       (advantages.gae)
    G_t     = A_t + V_t                                  the critic's target (returns)
    A_t    <- (A_t - mean) / (std + eps)                 over every loss token of the step

next(t) is the next loss token of the same row (prompt, environment and padding tokens
are skipped; after the last one V = A = 0). R_i is sample i's reward (`RLSample.reward`),
beta `rl.kl_in_reward` with pi_old the sampling policy (the update's recomputed
logprobs where they exist, else the engine's), gamma `rl.gae_gamma`, lambda
`rl.gae_lambda`. The whitening's mean and std, and the metrics, are over the loss
tokens of the whole step on every data-parallel rank:

    advantages_mean, advantages_std   of A_t before whitening
    returns_mean, values_mean         of G_t and V_t
    explained_variance = 1 - Var[G - V] / Var[G]    (1: V predicts the returns; 0: no
                                                     better than their mean; 0 if G is constant)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from moerl.data.rl_batch import RLMicroBatch, RLSample
from moerl.rl.advantages import gae
from moerl.rl.token_returns import token_rewards, whiten_over_step

# The step's sums over loss tokens, in this order (one all-reduce).
_SUMS = ("n", "a", "a2", "g", "v", "d", "d2", "g2", "penalty")


def row_rewards(micro: RLMicroBatch, samples: Sequence[RLSample]) -> torch.Tensor:
    """(B,) the reward of each row's sample (`micro` packed from `samples`); 0 for padding."""
    rewards = torch.zeros(micro.shape[0])
    for row, index in enumerate(micro.sample_index):
        rewards[row] = float(samples[index].reward)
    return rewards


def gae_advantages(
    micro: Sequence[RLMicroBatch], values: Sequence[torch.Tensor], rewards: Sequence[torch.Tensor],
    old: Sequence[torch.Tensor | None], ref: Sequence[torch.Tensor | None], kl_coef: float,
    gamma: float, lam: float, group: dist.ProcessGroup | None,
) -> tuple[list[RLMicroBatch], list[torch.Tensor], dict[str, float]]:
    """(`micro` with whitened per-token advantages, the returns G (B, T) per micro-batch,
    the step's metrics). Per micro-batch k: `values[k]` (B, T), `rewards[k]` (B,),
    `old[k]`/`ref[k]` the sampling policy's and the reference's logprobs (None where not
    computed; the engine's logprobs stand in for the sampling policy's)."""
    advantages, returns = [], []
    sums = torch.zeros(len(_SUMS), dtype=torch.float64)
    for k, mb in enumerate(micro):
        behaviour = old[k] if old[k] is not None else mb.rollout_logprobs
        mask = mb.loss_mask
        r, penalty = token_rewards(rewards[k], mask, behaviour, ref[k], kl_coef)
        v = values[k].float()
        a, g = gae(r, v, mask, gamma, lam)
        advantages.append(a)
        returns.append(g)
        sums += _token_sums(a, g, v, penalty, mask)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    masks = [mb.loss_mask for mb in micro]
    whitened = whiten_over_step(advantages, masks, group)
    out = [dataclasses.replace(mb, advantages=a) for mb, a in zip(micro, whitened, strict=True)]
    return out, returns, step_metrics(dict(zip(_SUMS, sums.tolist(), strict=True)))


def _token_sums(a: torch.Tensor, g: torch.Tensor, v: torch.Tensor, penalty: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    keep = mask.bool()
    a, g, v = a[keep].double(), g[keep].double(), v[keep].double()
    d = g - v
    parts = [torch.tensor(float(a.numel()), dtype=torch.float64), a.sum(), (a * a).sum(),
             g.sum(), v.sum(), d.sum(), (d * d).sum(), (g * g).sum(),
             penalty[keep].double().sum()]
    return torch.stack(parts)


def _variance(total: float, squares: float, n: float) -> float:
    """Unbiased variance from a sum and a sum of squares of n values."""
    mean = total / n
    return max((squares - n * mean * mean) / (n - 1), 0.0)


def step_metrics(s: dict[str, float]) -> dict[str, float]:
    """The module docstring's metrics from the step's sums over loss tokens."""
    n = s["n"]
    if n < 2:
        raise ValueError("gae: the step needs at least two loss tokens")
    var_g = _variance(s["g"], s["g2"], n)
    var_d = _variance(s["d"], s["d2"], n)
    return {
        "advantages_mean": s["a"] / n,
        "advantages_std": _variance(s["a"], s["a2"], n) ** 0.5,
        "returns_mean": s["g"] / n,
        "values_mean": s["v"] / n,
        "explained_variance": 1.0 - var_d / var_g if var_g > 0 else 0.0,
        "kl_in_reward": s["penalty"] / n,
    }
