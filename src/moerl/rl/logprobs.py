"""Per-token logprobs and entropy from vocabulary-parallel logits, never gathering V.

Under tensor parallelism each rank holds logits for its slice [start, start + V/tp) of the
vocabulary. With z the logits shifted by their global maximum m (a constant, so it needs
no gradient),

    log p(y) = z_y - log S,      S = sum_v exp(z_v)
    H        = log S - (sum_v exp(z_v) z_v) / S

and every sum over v is a local sum followed by an all-reduce over the TP group. The
all-reduces are Megatron's `reduce_from_tensor_model_parallel_region` (forward: sum;
backward: identity), so each rank back-propagates the replicated scalar into its own
slice, as `vocab_parallel_cross_entropy` does. At tp = 1 the reductions are no-ops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def _vocab_start(local_vocab: int, group: dist.ProcessGroup | None) -> int:
    rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
    return rank * local_vocab


def _all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    return reduce_from_tensor_model_parallel_region(x, group=group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T, V/tp) local logits and (B, T) labels -> (B, T) log p(label), (B, T) entropy.

    Computed in fp32 whatever the logits' dtype; differentiable in the logits.
    """
    z = logits.float()
    # The global max, for stability only: any constant shift gives the same values.
    m = z.detach().max(dim=-1, keepdim=True).values  # (B, T, 1)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = z - m
    exp_z = z.exp()  # (B, T, V/tp)
    sum_exp = _all_reduce_sum(exp_z.sum(dim=-1), group)  # (B, T)
    log_s = sum_exp.log()

    # The label's logit lives on exactly one rank; the others contribute 0.
    local_v = z.shape[-1]
    start = _vocab_start(local_v, group)
    local = labels - start  # (B, T)
    here = (local >= 0) & (local < local_v)
    picked = z.gather(-1, local.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)  # (B, T)
    picked = torch.where(here, picked, torch.zeros_like(picked))
    logprobs = _all_reduce_sum(picked, group) - log_s

    entropy = None
    if with_entropy:
        weighted = _all_reduce_sum((exp_z * z).sum(dim=-1), group)  # (B, T)
        entropy = log_s - weighted / sum_exp
    return logprobs, entropy
