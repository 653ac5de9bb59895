"""Ring attention and the context-parallel data path, in one process.

The multi-rank ring itself is checked under torchrun in
tests/distributed/test_ring_attention_parity.py; here: the merge rule, the causal
shortcut, the chunk split against Megatron's own, and packed-sequence masking.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from megatron.core import utils as mcore_utils

from moerl.models.ring_attention import _block_slices, _mask, merge_partial, ring_attention
from moerl.parallel.context import (
    chunk_ids,
    document_ids,
    local_positions,
    packed_position_ids,
    split_batch,
    split_for_cp_rank,
)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention: q [..., sq, d], allowed bool [.., sq, sk] -> out, lse."""
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def test_merge_of_disjoint_key_sets_is_full_attention() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 8), torch.randn(2, 10, 8), torch.randn(2, 10, 5)
    allowed = torch.rand(2, 6, 10) > 0.4
    allowed[:, 0] = False  # a row no key reaches in either part
    allowed[:, 0, 2] = True
    full, full_lse = _reference(q, k, v, allowed, 0.3)
    # Keys 0..3 and 4..9 separately; row 0 sees nothing in the second part.
    a, a_lse = _reference(q, k[:, :4], v[:, :4], allowed[..., :4], 0.3)
    b, b_lse = _reference(q, k[:, 4:], v[:, 4:], allowed[..., 4:], 0.3)
    b = torch.nan_to_num(b)  # the empty row: softmax of all -inf
    merged, lse = merge_partial(a, a_lse, b, b_lse)
    torch.testing.assert_close(merged, full, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-6)
    # Starting from "nothing seen yet" (lse = -inf, out = 0) is exact too.
    empty, empty_lse = torch.zeros_like(a), torch.full_like(a_lse, float("-inf"))
    again, _ = merge_partial(empty, empty_lse, merged, lse)
    assert torch.equal(again, merged)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_causal_shortcut_only_skips_masked_pairs(cp: int) -> None:
    seq, chunk = 8 * cp, 4
    for rank in range(cp):
        for src in range(cp):
            qs, ks = _block_slices(src, rank, chunk, causal=True)
            q_pos, k_pos = local_positions(seq, rank, cp), local_positions(seq, src, cp)
            mask = _mask(q_pos, k_pos, None, None, causal=True)
            assert mask is not None
            kept = torch.zeros_like(mask)
            kept[..., qs, ks] = True
            assert not (mask & ~kept).any(), (rank, src)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_matches_megatron_and_round_trips(cp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = torch.arange(3 * 16).reshape(3, 16)
    shares = []
    for rank in range(cp):
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: cp)
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=rank: r)
        theirs = mcore_utils.get_batch_on_this_cp_rank(
            {"tokens": tokens.clone(), "cu_seqlens": None}, is_hybrid_cp=False, cp_group=None
        )["tokens"]
        mine = split_for_cp_rank(tokens, rank, cp)
        assert torch.equal(mine, theirs)
        assert torch.equal(mine[0], local_positions(16, rank, cp))
        shares.append(mine)
    # Reassemble as gather_from_cp does: rank r's halves are chunks r and 2cp-1-r.
    chunks: dict[int, torch.Tensor] = {}
    for rank, share in enumerate(shares):
        first, second = chunk_ids(rank, cp)
        chunks[first], chunks[second] = share.chunk(2, dim=1)
    assert torch.equal(torch.cat([chunks[i] for i in range(2 * cp)], dim=1), tokens)


def test_split_batch_dataclass_and_dict() -> None:
    from moerl.data.synthetic import Batch

    full = torch.arange(8).unsqueeze(0)
    batch = Batch(full, full + 1, torch.ones(1, 8), full)
    part = split_batch(batch, 1, 2)
    assert part.tokens.tolist() == [[2, 3, 4, 5]] and part.labels.tolist() == [[3, 4, 5, 6]]
    as_dict: dict[str, torch.Tensor | None] = {"tokens": full, "note": None}
    as_dict = split_batch(as_dict, 0, 2)
    assert as_dict["note"] is None and as_dict["tokens"] is not None
    assert as_dict["tokens"].tolist() == [[0, 1, 6, 7]]
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        split_for_cp_rank(torch.zeros(1, 6), 0, 2)


def test_document_ids_and_positions() -> None:
    cu = torch.tensor([0, 3, 7, 9], dtype=torch.int32)  # tokens 9..11 are padding
    assert document_ids(cu, 12).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3]
    assert packed_position_ids(cu, 12).tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2]
    rows = torch.tensor([[0, 5, 8, 8], [0, 2, 4, 8]])  # per row, right-padded with T
    assert document_ids(rows, 8).tolist() == [[0] * 5 + [1] * 3, [0, 0, 1, 1, 2, 2, 2, 2]]


@pytest.mark.parametrize("per_row", [False, True])
def test_packed_causal_attention_matches_per_document_reference(per_row: bool) -> None:
    """One rank (CP = 1): the ring's own forward and backward against autograd."""
    torch.manual_seed(1)
    s, b, h, dk, dv = 12, 2, 3, 6, 4  # MLA-like: qk head dim != v head dim
    q, k = torch.randn(s, b, h, dk), torch.randn(s, b, h, dk)
    v = torch.randn(s, b, h, dv)
    cu = torch.tensor([[0, 5, 9, 12], [0, 2, 12, 12]]) if per_row else torch.tensor([0, 4, 12])
    scale = 1 / math.sqrt(dk)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(leaves[0], leaves[1], leaves[2], None, softmax_scale=scale, cu_seqlens=cu)
    docs = document_ids(cu, s).expand(b, s)  # [b, s]
    allowed = (docs[:, :, None] == docs[:, None, :]) & torch.ones(s, s).tril().bool()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    qr, kr, vr = (t.permute(1, 2, 0, 3) for t in ref_leaves)  # [b, h, s, d]
    ref, _ = _reference(qr, kr, vr, allowed[:, None], scale)
    ref = ref.permute(2, 0, 1, 3)  # [s, b, h, dv]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    for mine, theirs in zip(leaves, ref_leaves, strict=True):
        assert mine.grad is not None and theirs.grad is not None
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-5)
