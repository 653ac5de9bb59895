"""Per-token advantages that need the update's own forwards: REINFORCE++ with an
optional KL penalty in the reward (`rl.advantage=reinforce_pp`, `rl.kl_in_reward`).

Scoring leaves each sample's raw reward R_i as its advantage; once the reference
logprobs of every micro-batch of the step are known (`Peers.prepare`), this turns
them into (Hu 2025, `advantages.reinforce_plus_plus`):

    r_t = -beta * (log pi_old(t) - log pi_ref(t))   (+ R_i on the last loss token)
    G_t = sum_{s >= t} gamma^(s - t) r_s
    A_t = (G_t - mean) / (std + eps)   over every loss token of the step

beta is `rl.kl_in_reward` (0: no penalty), pi_old the policy that sampled (the
update's recomputed logprobs where they exist, else the engine's), the KL estimate
the per-token log ratio (k1). The mean and std are over the whole step, every
data-parallel rank's tokens together: no per-prompt baseline and no critic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from moerl.data.rl_batch import RLMicroBatch
from moerl.rl.advantages import discounted_returns, last_token_rewards


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor, behaviour: torch.Tensor | None,
                  ref: torch.Tensor | None, kl_coef: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_t (B, T), the KL penalty per token (B, T)) of one micro-batch: each row's reward
    (B,) on its last loss token, minus beta * (log pi_old - log pi_ref) on every loss
    token; 0 on padding rows and off the mask."""
    rows = mask.bool().any(dim=-1)  # rows that are samples (not padding)
    token_r = torch.zeros_like(mask)
    token_r[rows] = last_token_rewards(rewards[rows].float(), mask[rows])
    penalty = torch.zeros_like(mask)
    if kl_coef:
        if behaviour is None or ref is None:
            raise ValueError("rl.kl_in_reward: needs the sampling policy's and the reference's "
                             "logprobs (a reference model and rollout logprobs)")
        penalty = kl_coef * (behaviour.float() - ref.float()) * mask
    return token_r - penalty, penalty


def step_returns(micro: RLMicroBatch, behaviour: torch.Tensor | None,
                 ref: torch.Tensor | None, kl_coef: float, gamma: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(returns (B, T), the KL penalty per token (B, T)) of one micro-batch whose
    `advantages` hold the samples' rewards (B,)."""
    if micro.advantages.dim() != 1:
        raise ValueError("reinforce_pp: scoring must leave one reward per sample")
    r, penalty = token_rewards(micro.advantages, micro.loss_mask, behaviour, ref, kl_coef)
    return discounted_returns(r, micro.loss_mask, gamma), penalty


def whiten_over_step(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor],
                     group: dist.ProcessGroup | None, eps: float = 1e-8) -> list[torch.Tensor]:
    """Each (B, T) of `values` whitened by the mean and std of every masked entry of all
    of them, on every data-parallel rank of `group`; 0 off the mask."""
    total = torch.zeros(3, dtype=torch.float64)
    for v, m in zip(values, masks, strict=True):
        picked = v[m.bool()].double()
        total += torch.stack([picked.sum(), (picked * picked).sum(),
                              torch.tensor(float(picked.numel()), dtype=torch.float64)])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    s, sq, n = total.tolist()
    if n < 2:
        raise ValueError("per-token advantages: the step needs at least two loss tokens to "
                         "whiten them")
    mean = s / n
    std = max((sq - n * mean * mean) / (n - 1), 0.0) ** 0.5
    return [torch.where(m.bool(), (v - mean) / (std + eps), torch.zeros_like(v))
            for v, m in zip(values, masks, strict=True)]


def reinforce_pp(micro: Sequence[RLMicroBatch], old: Sequence[torch.Tensor | None],
                 ref: Sequence[torch.Tensor | None], kl_coef: float, gamma: float,
                 group: dist.ProcessGroup | None) -> tuple[list[RLMicroBatch], dict[str, float]]:
    """`micro` with per-token REINFORCE++ advantages, and the step's KL-penalty metric.
    `old[k]`/`ref[k]`: micro-batch k's sampling-policy and reference logprobs (None
    where not computed; the engine's logprobs stand in for the sampling policy's)."""
    returns, penalties = [], []
    for k, mb in enumerate(micro):
        behaviour = old[k] if old[k] is not None else mb.rollout_logprobs
        r, p = step_returns(mb, behaviour, ref[k], kl_coef, gamma)
        returns.append(r)
        penalties.append(p)
    masks = [mb.loss_mask for mb in micro]
    whitened = whiten_over_step(returns, masks, group)
    tokens = sum(float(m.sum()) for m in masks)
    metrics = {"kl_in_reward": sum(float(p.sum()) for p in penalties) / max(tokens, 1.0)}
    return [dataclasses.replace(mb, advantages=a) for mb, a in zip(micro, whitened, strict=True)], \
        metrics
