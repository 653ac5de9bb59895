"""Ring attention: exact attention across a context-parallel (CP) group, without TE.

CP rank r holds chunks r and 2·CP−1−r of the sequence's 2·CP (`parallel.context`).
Queries stay put; every rank's keys and values travel once around the ring
(r sends to r+1, receives from r−1, point to point, the next block in flight
while the current one is computed). Partial softmaxes over part of the keys merge
exactly by the log-sum-exp rule (`merge_partial`). Causal masking compares global
token positions, so the result equals causal attention over the whole sequence.

With causal masking, half of every off-diagonal step is provably empty and
skipped: keys from a lower rank are only visible through their first chunk, and
keys from a higher rank only to our second chunk. Every rank does the same work.

Backward: a ring of its own (no recomputation of the forward ring). Queries,
keys, values, output and log-sum-exp are saved; the keys and values go around the
ring again, each with an accumulator of its dK/dV that collects every rank's
share and, after one more hop, arrives home. dQ stays local.

Packed sequences: pass Megatron's `PackedSeqParams(qkv_format="sbhd",
cu_seqlens_q=...)` where `cu_seqlens_q` holds the document boundaries of the
whole (unsplit) row — int [n_docs + 1] for every row, or [b, n + 1] per row,
right-padded with repeats of T — and `cu_seqlens_kv` is None or the same tensor.
Tokens attend only within their document. THD (flattened) packing is not
supported: the batch stays [s, b, h, d] and is split per row.

Not supported (clear error): attention dropout, attention bias, dense attention
masks, sliding windows, non-vanilla softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from moerl.parallel.context import document_ids, local_positions

NEG_INF = float("-inf")


@dataclass(frozen=True)
class _Ring:
    group: dist.ProcessGroup | None
    rank: int  # in the CP group, of `size`; next/prev are the neighbours' global ranks
    size: int
    next: int
    prev: int


def _ring(group: dist.ProcessGroup | None) -> _Ring:
    if group is None or group.size() == 1:
        return _Ring(group, 0, 1, -1, -1)
    rank, size = group.rank(), group.size()
    after = dist.get_global_rank(group, (rank + 1) % size)
    before = dist.get_global_rank(group, (rank - 1) % size)
    return _Ring(group, rank, size, after, before)


class _Shift:
    """`tensor` on its way to the next rank while the previous rank's arrives."""

    def __init__(self, tensor: torch.Tensor, ring: _Ring, tag: int) -> None:
        self.received = torch.empty_like(tensor)
        self.requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, ring.next, ring.group, tag),
            dist.P2POp(dist.irecv, self.received, ring.prev, ring.group, tag),
        ])

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.received


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # Rows that no key reaches have lse = -inf; use 0 there so exp(-inf - 0) = 0, not NaN.
    return lse.masked_fill(lse == NEG_INF, 0.0)


def merge_partial(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two softmax-attention results over disjoint key sets (online softmax).

    out, block_out [..., sq, dv] are each normalised over their own keys; lse,
    block_lse [..., sq] are the log-sum-exp of their scores. The result is the
    attention over the union: weights exp(lse - lse_union), summing to one.
    """
    union = torch.logaddexp(lse, block_lse)
    ref = _finite(union)
    merged = (out * torch.exp(lse - ref).unsqueeze(-1)
              + block_out * torch.exp(block_lse - ref).unsqueeze(-1))
    return merged, union


def _mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor,
    q_doc: torch.Tensor | None, k_doc: torch.Tensor | None, causal: bool,
) -> torch.Tensor | None:
    """Which (query, key) pairs may attend: bool [b or 1, 1, sq, sk], None for all.

    q_pos [sq], k_pos [sk] are global positions; q_doc [b, sq], k_doc [b, sk] ids.
    """
    mask = None
    if causal:
        mask = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1))[None, None]
    if q_doc is not None and k_doc is not None:
        same = (q_doc.unsqueeze(2) == k_doc.unsqueeze(1)).unsqueeze(1)
        mask = same if mask is None else mask & same
    return mask


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    # [b, h, sq, dk] x [b, h, sk, dk] -> fp32 [b, h, sq, sk]
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    return scores if mask is None else scores.masked_fill(~mask, NEG_INF)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: output fp32 [b, h, sq, dv] normalised over these keys, lse fp32 [b, h, sq]."""
    scores = _scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return torch.matmul(probs, v.float()), lse


def _attend_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
    dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (fp32) of one block, from the final lse and delta = rowsum(dout * out)."""
    q, k, v = q.float(), k.float(), v.float()
    probs = torch.exp(_scores(q, k, mask, scale) - _finite(lse).unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dscores = probs * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1)) * scale
    return torch.matmul(dscores, k), torch.matmul(dscores.transpose(-1, -2), q), dv


def _block_slices(src: int, rank: int, chunk: int, causal: bool) -> tuple[slice, slice]:
    """The local queries and arriving keys (from CP rank `src`) that can interact.

    Only a shortcut: the mask is still applied, so a wrong slice could only drop work.
    """
    everything = slice(None)
    if not causal or src == rank:
        return everything, everything
    if src < rank:  # chunk src precedes all our tokens; chunk 2CP-1-src follows them all
        return everything, slice(0, chunk)
    return slice(chunk, None), everything  # both chunks of src precede only our second


@dataclass(frozen=True)
class _Layout:
    """What every rank knows about the sequence: positions [P, s], doc ids [P, b, s] | None."""

    ring: _Ring
    positions: torch.Tensor
    docs: torch.Tensor | None
    scale: float
    causal: bool

    def mask(self, src: int, qs: slice, ks: slice) -> torch.Tensor | None:
        """Our queries `qs` against the keys `ks` that CP rank `src` holds."""
        rank, docs = self.ring.rank, self.docs
        q_doc = None if docs is None else docs[rank][:, qs]
        k_doc = None if docs is None else docs[src][:, ks]
        return _mask(self.positions[rank][qs], self.positions[src][ks], q_doc, k_doc, self.causal)


class _RingAttention(torch.autograd.Function):
    """q [b, h, s, dk], k [b, h, s, dk], v [b, h, s, dv] (local) -> out [b, h, s, dv]."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: _Layout
    ) -> torch.Tensor:
        ring, dk = lay.ring, q.size(-1)
        out = q.new_zeros(*q.shape[:-1], v.size(-1), dtype=torch.float32)
        lse = q.new_full(q.shape[:-1], NEG_INF, dtype=torch.float32)
        kv = torch.cat([k, v], dim=-1)  # [b, h, s, dk + dv], one message per step
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            shift = _Shift(kv, ring, tag=0) if step < ring.size - 1 else None
            qs, ks = _block_slices(src, ring.rank, q.size(2) // 2, lay.causal)
            block_out, block_lse = _attend(
                q[:, :, qs], kv[:, :, ks, :dk], kv[:, :, ks, dk:], lay.mask(src, qs, ks), lay.scale
            )
            out[:, :, qs], lse[:, :, qs] = merge_partial(
                out[:, :, qs], lse[:, :, qs], block_out, block_lse
            )
            if shift is not None:
                kv = shift.wait()
        ctx.lay = lay
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        lay: _Layout = ctx.lay
        ring, dk = lay.ring, q.size(-1)
        dout = dout.float()
        delta = (dout * out).sum(-1)  # [b, h, s]
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.cat([k, v], dim=-1)
        incoming: _Shift | None = None  # the dK/dV accumulator of the block we hold next
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            shift = _Shift(kv, ring, tag=0) if step < ring.size - 1 else None
            qs, ks = _block_slices(src, ring.rank, q.size(2) // 2, lay.causal)
            dq_b, dk_b, dv_b = _attend_backward(
                q[:, :, qs], kv[:, :, ks, :dk], kv[:, :, ks, dk:], lay.mask(src, qs, ks),
                lay.scale, dout[:, :, qs], lse[:, :, qs], delta[:, :, qs],
            )
            dq[:, :, qs] += dq_b
            acc = torch.zeros_like(kv, dtype=torch.float32)  # [b, h, s, dk + dv] of block src
            acc[:, :, ks] = torch.cat([dk_b, dv_b], dim=-1)
            if incoming is not None:
                acc += incoming.wait()
            # After the last step this hop carries the finished block home.
            incoming = _Shift(acc, ring, tag=1) if ring.size > 1 else None
            if shift is not None:
                kv = shift.wait()
        dkv = incoming.wait() if incoming is not None else acc
        return (dq.to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype), None)


def ring_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    group: dist.ProcessGroup | None, *, softmax_scale: float, causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this rank's share of the sequence, in Megatron's layout.

    query, key [s, b, h, dk] and value [s, b, h, dv] hold this rank's tokens
    (chunks r and 2CP-1-r, s = T / CP); `cu_seqlens` the document boundaries of
    the whole row ([n + 1] or [b, n + 1]), or None. Returns [s, b, h, dv].
    """
    ring = _ring(group)
    s = query.size(0)
    if ring.size == 1:
        positions = torch.arange(s, device=query.device).unsqueeze(0)
    else:
        positions = torch.stack([
            local_positions(s * ring.size, r, ring.size, device=query.device)
            for r in range(ring.size)
        ])  # [P, s]
    docs = None
    if cu_seqlens is not None:
        full = document_ids(cu_seqlens.to(query.device), s * ring.size)  # [T] or [b, T]
        docs = full[..., positions]  # [P, s] or [b, P, s]
        docs = docs.unsqueeze(1) if docs.dim() == 2 else docs.transpose(0, 1)  # [P, b|1, s]
    lay = _Layout(ring, positions, docs, softmax_scale, causal)
    q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))
    out = _RingAttention.apply(q, k, v, lay)  # [b, h, s, dv]
    return out.permute(2, 0, 1, 3)


class RingDotProductAttention(MegatronModule):
    """Core attention for the local spec when the sequence is split over CP ranks.

    A drop-in for `DotProductAttention` (standard attention) and for MLA's core
    attention (`k_channels` ≠ `v_channels`): query [s, b, np, dk], key/value
    [s, b, ng, dk | dv] with heads already split by TP (and the sequence already
    gathered by sequence parallelism) -> [s, b, np * dv]. Also exact at CP = 1.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout > 0 or config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError(
                "ring attention supports neither attention dropout, nor softmax_type other "
                "than 'vanilla', nor sliding windows; set attention_dropout=0, "
                "softmax_type='vanilla', window_size=None, or use Transformer Engine"
            )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group: dist.ProcessGroup | None = getattr(pg_collection, "cp", None)
        if self.cp_group is None and ps.model_parallel_is_initialized():
            self.cp_group = ps.get_context_parallel_group()
        heads = divide(config.num_attention_heads, pg_collection.tp.size())
        k_channels = k_channels or config.kv_channels
        v_channels = v_channels or config.kv_channels
        self.hidden_size_per_partition = heads * v_channels
        # As DotProductAttention: 1/sqrt(head dim) unless given (MLA gives its own).
        # Its query-key layer scaling divides and multiplies back by the layer
        # number, a no-op in exact arithmetic, so it is left out here.
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(k_channels)
        self.attn_mask_type = attn_mask_type
        self.documents: PackedSeqParams | None = None
        """Boundaries set by MLA for one forward (`models.mla_local`), used when the
        call itself carries none."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "ring attention takes no dense attention mask or bias (a mask over this "
                "rank's tokens cannot describe keys on other ranks); give document "
                "boundaries through PackedSeqParams(qkv_format='sbhd', cu_seqlens_q=...)"
            )
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"ring attention: mask type {mask_type} is not supported")
        # [s, b, ng, d] -> [s, b, np, d] (grouped-query attention)
        repeat = query.size(2) // key.size(2)
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        out = ring_attention(
            query, key, value, self.cp_group, softmax_scale=self.softmax_scale,
            causal=mask_type == AttnMaskType.causal,
            cu_seqlens=_document_boundaries(packed_seq_params or self.documents),
        )  # [s, b, np, dv]
        return out.reshape(out.size(0), out.size(1), self.hidden_size_per_partition)


def _document_boundaries(params: PackedSeqParams | None) -> torch.Tensor | None:
    if params is None:
        return None
    if params.qkv_format != "sbhd":
        raise ValueError(
            f"ring attention: packed sequences must use qkv_format='sbhd' with the whole "
            f"row's boundaries in cu_seqlens_q, got qkv_format={params.qkv_format!r}"
        )
    q, kv = params.cu_seqlens_q, params.cu_seqlens_kv
    if kv is not None and q is not None and not torch.equal(q, kv):
        raise ValueError("ring attention: self-attention needs cu_seqlens_kv == cu_seqlens_q")
    return q


def ring_attention_spec_patch(block_spec: Any) -> None:
    """Make every layer of `block_spec` (a TransformerBlockSubmodules) use ring attention.

    For the local spec when cp > 1 and Transformer Engine is absent. The MTP block
    spec reuses the object of the last layer's spec, so MTP layers follow.
    """
    for layer in block_spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = RingDotProductAttention
