"""One forward of the continuous engine, as index tensors built once and read by every layer.

A step feeds segments: each a run of consecutive positions [start, start + count) of
one sequence (one token for a decoding row, a chunk of prompt for a prefilling one).
Their tokens are laid out one after another in a flat axis of T tokens; every
projection, norm and MoE layer runs on that axis at once ([T, 1, hidden], as Megatron's
modules take [s, b, h]).

Attention is batched over segments of similar key length: segments are sorted by
their key length (start + count) and cut into buckets whose longest is at most about
twice the shortest, so padding costs at most about as much as the keys themselves.
A bucket of B segments pads queries to Qmax and keys to Kmax, and carries
- `key_blocks` [B, Kmax / block_size]: the cache blocks of positions 0..Kmax-1, whole
  blocks (a gather of whole blocks copies runs of block_size rows; padding reads the
  null block; a block's unwritten tail is zero when handed out, and masked),
- `mask` [B, Qmax, Kmax]: 0 where query i may see key k (k <= its position), -inf elsewhere,
- `query_index` [B, Qmax]: each padded query's token in the flat axis (a padded query
  repeats its segment's last token; its output is dropped), None for decoding buckets,
  whose B tokens are already contiguous,
- `valid` [n]: which of the B x Qmax outputs are real, in token order (None when all are).
Tokens are laid out bucket after bucket, so the buckets' outputs concatenated are in
token order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# A bucket's longest key length may reach max(2 x its shortest, shortest + this).
_BUCKET_SLACK = 128


@dataclass(frozen=True)
class Segment:
    """Positions [start, start + len(tokens)) of the sequence in block-table row `row`."""

    row: int
    start: int
    tokens: Sequence[int]


@dataclass
class Bucket:
    tokens: slice  # its tokens in the flat axis
    key_blocks: torch.Tensor  # [B, Kmax / block_size] long
    mask: torch.Tensor  # [B, Qmax, Kmax] float
    query_index: torch.Tensor | None  # [B, Qmax] long; None: queries are `tokens`, Qmax 1
    valid: torch.Tensor | None  # [n] long into B * Qmax; None: all

    @property
    def decoding(self) -> bool:
        return self.query_index is None


@dataclass
class StepPlan:
    segments: list[Segment]  # in token order
    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    write_slots: torch.Tensor  # [T] long: where each token's key/value is stored
    buckets: list[Bucket]
    last_token: list[int]  # per segment: its last token's index in the flat axis
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())


def _buckets(segments: Sequence[Segment]) -> list[list[Segment]]:
    """Decoding (one-token) segments and chunked ones apart, each sorted by key length
    and cut where the key length outgrows the bucket's first."""
    out: list[list[Segment]] = []
    for family in ([s for s in segments if len(s.tokens) == 1],
                   [s for s in segments if len(s.tokens) > 1]):
        family.sort(key=lambda s: s.start + len(s.tokens))
        bucket: list[Segment] = []
        first = 0
        for seg in family:
            keys = seg.start + len(seg.tokens)
            if bucket and keys > max(2 * first, first + _BUCKET_SLACK):
                out.append(bucket)
                bucket = []
            if not bucket:
                first = keys
            bucket.append(seg)
        if bucket:
            out.append(bucket)
    return out


def plan_step(segments: Sequence[Segment], block_table: torch.Tensor,
              block_size: int) -> StepPlan:
    """The step's index tensors. `block_table` [rows, max_blocks] holds each row's blocks."""
    device = block_table.device
    groups = _buckets(segments)
    ordered = [s for g in groups for s in g]
    counts = [len(s.tokens) for s in ordered]
    flat = [t for s in ordered for t in s.tokens]
    token_ids = torch.tensor(flat, dtype=torch.long, device=device)  # [T]
    count_t = torch.tensor(counts, dtype=torch.long, device=device)  # [S]
    start_t = torch.tensor([s.start for s in ordered], dtype=torch.long, device=device)
    row_t = torch.tensor([s.row for s in ordered], dtype=torch.long, device=device)
    first_tok = torch.cumsum(count_t, 0) - count_t  # [S]
    seg_of = torch.repeat_interleave(torch.arange(len(ordered), device=device), count_t)  # [T]
    positions = start_t[seg_of] + torch.arange(len(flat), device=device) - first_tok[seg_of]
    write_slots = block_table[row_t[seg_of], positions // block_size] * block_size \
        + positions % block_size  # [T]
    buckets: list[Bucket] = []
    seg_at = tok_at = 0
    for group in groups:
        n = len(group)
        tokens_in = sum(counts[seg_at: seg_at + n])
        buckets.append(_bucket(group, row_t[seg_at: seg_at + n], start_t[seg_at: seg_at + n],
                               count_t[seg_at: seg_at + n], first_tok[seg_at: seg_at + n],
                               block_table, block_size, slice(tok_at, tok_at + tokens_in)))
        seg_at += n
        tok_at += tokens_in
    last = torch.cumsum(count_t, 0) - 1
    return StepPlan(ordered, token_ids, positions, write_slots, buckets, last.tolist(),
                    block_size)


def _bucket(group: list[Segment], rows: torch.Tensor, starts: torch.Tensor,
            counts: torch.Tensor, first_tok: torch.Tensor, block_table: torch.Tensor,
            block_size: int, tokens: slice) -> Bucket:
    device = block_table.device
    q_max = max(len(s.tokens) for s in group)
    blocks = -(-max(s.start + len(s.tokens) for s in group) // block_size)
    key_blocks = block_table[rows, :blocks]  # [B, Kmax / block_size]
    key_pos = torch.arange(blocks * block_size, device=device)  # [Kmax]
    offset = torch.minimum(torch.arange(q_max, device=device)[None, :],
                           counts[:, None] - 1)  # [B, Qmax]: padded queries repeat the last
    query_pos = starts[:, None] + offset  # [B, Qmax]
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Qmax, Kmax]
    mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
    if q_max == 1:
        return Bucket(tokens, key_blocks, mask, None, None)
    query_index = first_tok[:, None] + offset  # [B, Qmax]
    real = (torch.arange(q_max, device=device)[None, :] < counts[:, None]).reshape(-1)
    valid = None if bool(real.all()) else real.nonzero().squeeze(1)
    return Bucket(tokens, key_blocks, mask, query_index, valid)
