"""The data path of context parallelism (CP): split a batch across CP ranks, gather back.

Megatron's load-balanced split (`megatron.core.utils.get_batch_on_this_cp_rank`):
every row of T tokens is cut into 2·CP equal chunks and CP rank r keeps chunks r
and 2·CP−1−r, in that order. Under causal attention a chunk's cost grows with its
position, so pairing an early chunk with its mirror gives each rank the same work.
Example, CP=2, T=8: rank 0 holds tokens [0 1 | 6 7], rank 1 holds [2 3 | 4 5].

Packed sequences (several documents in one row) keep the same per-row split (what
Megatron calls per-sequence balancing): the document boundaries stay global — the
`cu_seqlens` of the whole row, never split — and each rank derives the document id
of each of its tokens from them (`document_ids`, then `split_for_cp_rank`). The ring
attention (`models.ring_attention`) takes those boundaries through `PackedSeqParams`.

Per-token results (logprobs, entropies) come back in the original order with
`gather_from_cp`; its backward keeps this rank's slice, which is right when every
CP rank computes the same loss from the gathered tensor.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch
import torch.distributed as dist


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the 2·CP sequence chunks that CP rank `cp_rank` holds, in order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside a context-parallel group of {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_divisible(seq_length: int, cp_size: int) -> None:
    if seq_length % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_length} must be divisible by 2*cp = {2 * cp_size} for the "
            f"load-balanced context-parallel split; pad the batch to a multiple of {2 * cp_size}"
        )


def local_positions(
    seq_length: int, cp_rank: int, cp_size: int, device: torch.device | None = None
) -> torch.Tensor:
    """Global positions of this rank's tokens: int64 [seq_length / cp_size]."""
    check_divisible(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    first, second = chunk_ids(cp_rank, cp_size)
    steps = torch.arange(chunk, device=device)
    return torch.cat([first * chunk + steps, second * chunk + steps])


def split_for_cp_rank(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's share of `x` along `dim` (the sequence): [.., T, ..] -> [.., T/CP, ..]."""
    if cp_size == 1:
        return x
    index = local_positions(x.size(dim), cp_rank, cp_size, device=x.device)
    return x.index_select(dim, index)


GLOBAL_FIELDS = frozenset({"cu_seqlens"})  # batch fields that are not split over CP ranks


def split_batch[T](batch: T, cp_rank: int, cp_size: int) -> T:
    """A batch with every [b, T, ...] tensor field split for this rank.

    `batch` is a dataclass (e.g. `data.synthetic.Batch`) or a dict. A field named
    `cu_seqlens` (document boundaries of the whole row) stays global; any other
    tensor whose dim 1 is not the sequence must not be in it. Non-tensor fields
    and None pass through.
    """
    def split(name: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and name not in GLOBAL_FIELDS:
            return split_for_cp_rank(value, cp_rank, cp_size, dim=1)
        return value

    if isinstance(batch, dict):
        return {k: split(k, v) for k, v in batch.items()}  # type: ignore[return-value]
    if is_dataclass(batch) and not isinstance(batch, type):
        changes = {f.name: split(f.name, getattr(batch, f.name)) for f in fields(batch)}
        return replace(batch, **changes)
    raise TypeError(f"split_batch: expected a dataclass or dict batch, got {type(batch)!r}")


def document_ids(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """Document index of every token of a packed row: int64 [T] (or [b, T]).

    `cu_seqlens` is [n_docs + 1] (or [b, n + 1]): 0, end of document 0, ..., T;
    rows of a 2-D tensor may be right-padded with repeats of T (Megatron's
    collation). Tokens at or after the last boundary (padding) get id n_docs.
    """
    positions = torch.arange(seq_length, device=cu_seqlens.device)
    bounds = cu_seqlens.to(torch.int64)
    if bounds.dim() == 1:
        return torch.searchsorted(bounds, positions, right=True) - 1
    rows = positions.expand(bounds.size(0), seq_length).contiguous()
    return torch.searchsorted(bounds.contiguous(), rows, right=True) - 1


def packed_position_ids(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """Positions that restart at 0 in each document: int64 [T] (or [b, T])."""
    docs = document_ids(cu_seqlens, seq_length)
    starts = cu_seqlens.to(torch.int64)  # document d starts at starts[d]
    positions = torch.arange(seq_length, device=cu_seqlens.device)
    return positions - torch.gather(starts, -1, docs)


def _gather_full(local: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    size = group.size()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    # Rank r's share is [chunk r | chunk 2CP-1-r]; put the 2CP chunks back in order.
    chunks: list[torch.Tensor | None] = [None] * (2 * size)
    for rank, part in enumerate(parts):
        first, second = chunk_ids(rank, size)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat([c for c in chunks if c is not None], dim=dim)


class _GatherFromCP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, group: dist.ProcessGroup, dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather_full(local, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Every rank computed the same loss from the full tensor: the gradient of
        # this rank's tokens is its own slice of the (identical) full gradient.
        mine = split_for_cp_rank(grad, ctx.group.rank(), ctx.group.size(), dim=ctx.dim)
        return mine.contiguous(), None, None


def gather_from_cp(
    local: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """Undo `split_for_cp_rank`: [.., T/CP, ..] on each rank -> [.., T, ..] on every rank.

    E.g. logprobs (B, T/CP) -> (B, T). Differentiable: see the module docstring.
    """
    if group is None or group.size() == 1:
        return local
    return _GatherFromCP.apply(local, group, dim)
