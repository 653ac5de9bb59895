"""How per-token loss values become one scalar, with every denominator named.

A global batch is split into micro-batches (gradient accumulation) and into shards
(data parallelism). Each micro-batch's loss is divided by a denominator counted over
the *whole global batch*, so that

    sum over DP ranks and micro-batches of aggregate(micro-batch)
        == aggregate(whole global batch)

holds exactly, and therefore so does the gradient. A mean taken per micro-batch would
instead weight short micro-batches more than long ones.

Modes, for per-token values x[i, t], loss mask m[i, t], n_i = sum_t m[i, t] (the loss
tokens of sequence i), N = sum_i n_i over the global batch and S = the number of
sequences in the global batch with at least one loss token:

    token-mean               sum_{i,t} m x / N
    seq-mean-token-mean      sum_i (sum_t m x / n_i) / S
    seq-mean-token-sum       sum_{i,t} m x / S
    seq-mean-token-sum-norm  sum_{i,t} m x / (S * L)        L a constant (Dr.GRPO: the
                                                            maximum response length)

seq-mean-token-mean needs each sequence whole inside one micro-batch (n_i is local);
packing keeps sequences whole, and context parallelism must reduce n_i across its group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moerl.rl.objective_config import AggregationMode


@dataclass(frozen=True)
class Denominator:
    """Counts over the whole global batch (all micro-batches, all DP ranks)."""

    num_tokens: float
    """N: loss tokens (mask == 1) in the global batch."""
    num_seqs: float
    """S: sequences with at least one loss token in the global batch (padding rows excluded)."""
    norm_len: float | None = None
    """L: the constant length of seq-mean-token-sum-norm (Dr.GRPO); None when unused."""

    def __post_init__(self) -> None:
        if self.num_tokens <= 0 or self.num_seqs <= 0:
            raise ValueError(
                f"global batch has no loss tokens (num_tokens={self.num_tokens}, "
                f"num_seqs={self.num_seqs}); every sample was masked out"
            )
        if self.norm_len is not None and self.norm_len <= 0:
            raise ValueError(f"norm_len must be positive, got {self.norm_len}")


def global_denominator(
    loss_masks: Iterable[torch.Tensor],
    norm_len: float | None = None,
    group: dist.ProcessGroup | None = None,
) -> Denominator:
    """Count tokens and sequences over this rank's micro-batches, summed over `group`.

    loss_masks: this rank's micro-batch masks, each (B_k, T_k). With `group` (the
    data-parallel group) the counts are all-reduced so every rank holds the global ones;
    without it the masks are taken to be the whole global batch.
    """
    tokens = torch.zeros((), dtype=torch.float64)
    seqs = torch.zeros((), dtype=torch.float64)
    for mask in loss_masks:
        m = mask.detach().to("cpu", torch.float64)
        tokens += m.sum()
        seqs += (m.sum(dim=-1) > 0).sum()
    if group is not None:
        counts = torch.stack([tokens, seqs])
        device = _collective_device(group)
        counts = counts.to(device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        tokens, seqs = counts.cpu().unbind()
    return Denominator(num_tokens=float(tokens), num_seqs=float(seqs), norm_len=norm_len)


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    # NCCL only reduces CUDA tensors; gloo reduces CPU tensors.
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def aggregate(
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: AggregationMode,
    denom: Denominator,
) -> torch.Tensor:
    """This micro-batch's share of the global-batch aggregate of `values`.

    values, loss_mask: (B, T). Returns a scalar; summing it over all micro-batches and
    DP ranks gives the aggregate of the global batch.
    """
    mask = loss_mask.to(values.dtype)
    # where() rather than values * mask: a masked position holding inf or nan (e.g. a
    # padded logprob) would turn the product into nan.
    masked = torch.where(loss_mask.bool(), values, torch.zeros_like(values))
    if mode is AggregationMode.TOKEN_MEAN:
        return masked.sum() / denom.num_tokens
    if mode is AggregationMode.SEQ_MEAN_TOKEN_MEAN:
        per_seq_tokens = mask.sum(dim=-1).clamp(min=1.0)  # (B,); empty rows add 0
        return (masked.sum(dim=-1) / per_seq_tokens).sum() / denom.num_seqs
    if mode is AggregationMode.SEQ_MEAN_TOKEN_SUM:
        return masked.sum() / denom.num_seqs
    if mode is AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM:
        if denom.norm_len is None:
            raise ValueError("seq-mean-token-sum-norm needs Denominator.norm_len (e.g. max length)")
        return masked.sum() / (denom.num_seqs * denom.norm_len)
    raise ValueError(f"unknown aggregation mode {mode!r}")


def token_share(values: torch.Tensor, loss_mask: torch.Tensor, denom: Denominator) -> torch.Tensor:
    """Additive token-mean of a metric: sums over micro-batches and ranks to the global mean.

    values, loss_mask: (B, T). Detached: metrics carry no gradient.
    """
    masked = torch.where(loss_mask.bool(), values.detach(), torch.zeros_like(values))
    return masked.sum() / denom.num_tokens


def masked_max(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Max over loss tokens (reduce across micro-batches with max); -inf when none."""
    masked = torch.where(loss_mask.bool(), values.detach(), torch.full_like(values, float("-inf")))
    return masked.max()


def seq_share(per_seq: torch.Tensor, loss_mask: torch.Tensor, denom: Denominator) -> torch.Tensor:
    """Additive sequence-mean of a per-sequence metric (B,), over rows with loss tokens."""
    has_loss = loss_mask.bool().any(dim=-1)  # (B,)
    masked = torch.where(has_loss, per_seq.detach(), torch.zeros_like(per_seq))
    return masked.sum() / denom.num_seqs
