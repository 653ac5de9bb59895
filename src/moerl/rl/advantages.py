"""Advantage estimators and reward shaping: pure functions of tensors.

Shapes: G groups of n samples of the same prompt give rewards (G, n); per-token
quantities are (B, T) with a loss mask (B, T) that is 1 on the tokens the policy
generated and 0 on prompt, environment (tool output) and padding tokens. Functions
that walk along T skip masked tokens, so an environment turn in the middle of a
multi-turn trajectory neither earns nor breaks credit assignment.

Advantages are computed once per step on the whole (global) batch, before it is split
into micro-batches, so "global batch normalisation" is a plain mean and std here.
"""

from __future__ import annotations

import torch


def group_normalized(
    rewards: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: A_ij = (R_ij - mean_j R_ij) / (std_j R_ij + eps); rewards (G, n) -> (G, n).

    std is the unbiased sample std of the group. With scale_by_std=False (Dr.GRPO)
    A_ij = R_ij - mean_j R_ij: dividing by std up-weights groups that are nearly all
    right or all wrong.
    """
    _check_groups(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: A_ij = R_ij - mean_{k != j} R_ik; (G, n) -> (G, n).

    Equals n / (n - 1) * (R_ij - mean_j R_ij), which is how it is computed.
    """
    _check_groups(rewards)
    n = rewards.shape[1]
    return (rewards - rewards.mean(dim=1, keepdim=True)) * (n / (n - 1))


def _check_groups(rewards: torch.Tensor) -> None:
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"rewards must be (groups, samples per group) with >= 2 samples, "
            f"got {tuple(rewards.shape)}"
        )


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of x (B, T); 0 where masked out."""
    m = mask.bool()
    vals = x[m]
    if vals.numel() < 2:
        raise ValueError("need at least two unmasked entries to whiten")
    out = (x - vals.mean()) / (vals.std() + eps)
    return torch.where(m, out, torch.zeros_like(out))


def last_token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence reward R_i (B,) on the last loss token of row i: (B, T)."""
    mask = loss_mask.bool()
    if not mask.any(dim=-1).all():
        raise ValueError("every sequence needs at least one loss token to carry its reward")
    t = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, t, -1).amax(dim=-1)  # (B,) index of the last loss token
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    out[torch.arange(mask.shape[0], device=mask.device), last] = rewards
    return out


def discounted_returns(
    token_rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """G_t = r_t + gamma * G_next(t), next(t) the next loss token of the row (0 after it).

    token_rewards, loss_mask: (B, T) -> (B, T), 0 on masked tokens.
    """
    mask = loss_mask.bool()
    running = torch.zeros_like(token_rewards[:, 0])  # (B,)
    out = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        # Masked tokens leave the running return as it is: they are not decision steps.
        running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(mask[:, t], running, torch.zeros_like(running))
    return out


def reinforce_plus_plus(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): token returns with a KL reward, whitened over the batch.

        r_t = -kl_coef * kl_t  (+ R_i on the last loss token of sequence i)
        A_t = whiten_batch( sum_{s >= t} gamma^(s-t) r_s )

    rewards (B,); loss_mask (B, T); kl (B, T) per-token KL to the reference (e.g.
    losses.kl.kl_penalty), or None. Returns (B, T) advantages, 0 on masked tokens.
    No critic and no per-prompt baseline: the batch mean and std are the baseline.
    """
    token_r = last_token_rewards(rewards, loss_mask)
    if kl is not None and kl_coef != 0.0:
        token_r = token_r - kl_coef * torch.where(loss_mask.bool(), kl, torch.zeros_like(kl))
    returns = discounted_returns(token_r, loss_mask, gamma)
    return masked_whiten(returns, loss_mask, eps)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation for PPO with a value model.

        delta_t = r_t + gamma * V_next(t) - V_t
        A_t     = delta_t + gamma * lam * A_next(t)
        returns = A_t + V_t      (the value model's regression target)

    next(t) is the next *loss* token of the same row (masked tokens are skipped); after
    the last one the episode ends, V = A = 0. token_rewards, values, loss_mask: (B, T).
    Returns (advantages, returns), both (B, T) and 0 on masked tokens; not whitened.
    """
    mask = loss_mask.bool()
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    next_adv = torch.zeros_like(values[:, 0])
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * next_adv
        valid = mask[:, t]
        adv[:, t] = torch.where(valid, a_t, torch.zeros_like(a_t))
        next_adv = torch.where(valid, a_t, next_adv)
        next_value = torch.where(valid, values[:, t], next_value)
    returns = torch.where(mask, adv + values, torch.zeros_like(values))
    return adv, returns


# --- DAPO overlong reward shaping -------------------------------------------------------


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """Soft penalty for responses close to the length limit, added to the reward.

        0                                     if len <= max_len - buffer
        factor * (max_len - buffer - len) / buffer   if max_len - buffer < len <= max_len
        -factor                               if len > max_len

    lengths (B,) response lengths in tokens -> (B,) float penalties (<= 0). The linear
    ramp gives a truncation a graded signal instead of one cliff at the limit.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"need 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    start = max_len - buffer
    ramp = (start - lengths.to(torch.float64)) / buffer  # (B,) 0 at start, -1 at max_len
    penalty = ramp.clamp(min=-1.0, max=0.0) * factor
    return penalty.to(torch.get_default_dtype())
