"""The sequences a continuous engine holds, and the cache blocks each one owns or shares.

A `Sequence` is one row being generated: its tokens so far (prompt, then sampled
tokens), how many of them are in the KV cache (`fed`), its blocks and its row of the
block table ([rows, max_blocks] long, read by `step_plan`).

Prefix sharing: copies of one prompt (a GRPO group's n samples, or the same prompt in
several requests) are prefilled once. The first copy admitted leads; the others follow
it and hold no prompt of their own: when the leader's prompt is in the cache, each
follower takes the leader's full blocks by reference (`BlockPool.share`) and a private
copy of the partly filled last block (its own tokens go there next: copy on write), and
samples its first token from the leader's logits. A follower that arrives after its
leader has moved on re-feeds the last prompt token to get those logits (one token, not
the prompt). A shared block is never written: positions below a follower's `fed` are
never fed again, and the block a follower writes next is its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moerl.rollout.paged_cache import NULL_BLOCK, PagedKVCache
from moerl.rollout.static_decode import DecodeRow


@dataclass(eq=False)
class Sequence:
    row: DecodeRow
    tokens: list[int]  # prompt + sampled tokens: what is fed, in order
    admitted: int = -1  # admission order (the latest admitted is preempted first)
    fed: int = 0  # tokens whose keys and values are in the cache
    blocks: list[int] = field(default_factory=list)
    table_row: int = -1
    prompt_key: tuple[int, ...] | None = None  # shareable prompt (None once preempted)
    leader: Sequence | None = None  # while following: the copy that prefills the prompt
    followers: list[Sequence] = field(default_factory=list)
    captured: int = 0  # positions whose routed experts are recorded

    @property
    def remaining(self) -> int:
        """Tokens to feed before the next one can be sampled."""
        return len(self.tokens) - self.fed



class SequenceBlocks:
    """Block-table rows and blocks of the live sequences of one cache."""

    def __init__(self, cache: PagedKVCache, max_sequence_length: int, max_rows: int) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.max_blocks = math.ceil(max_sequence_length / self.block_size)
        device = cache.store.device
        self.table = torch.full((max_rows + 1, self.max_blocks), NULL_BLOCK, dtype=torch.long,
                                device=device)  # row max_rows: an idle rank's stand-in token
        self.idle_row = max_rows
        self._free_rows = list(range(max_rows - 1, -1, -1))

    @property
    def pool_free(self) -> int:
        return self.cache.pool.free

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    def take_row(self, seq: Sequence, positions: int) -> bool:
        """A table row and blocks covering `positions` for `seq`; False (nothing taken) if
        either is lacking."""
        if not self._free_rows:
            return False
        blocks = self.cache.pool.allocate(self.blocks_for(positions))
        if blocks is None:
            return False
        seq.table_row = self._free_rows.pop()
        seq.blocks = []
        self.cache.zero_blocks(blocks)
        self._append(seq, blocks)
        return True

    def cover(self, seq: Sequence, positions: int) -> bool:
        """Blocks up to `positions`; False (nothing taken) when the pool runs out."""
        missing = self.blocks_for(positions) - len(seq.blocks)
        if missing <= 0:
            return True
        blocks = self.cache.pool.allocate(missing)
        if blocks is None:
            return False
        self.cache.zero_blocks(blocks)
        self._append(seq, blocks)
        return True

    def adopt(self, follower: Sequence, leader: Sequence, keep: int) -> None:
        """`follower` takes positions [0, keep) of `leader`'s cache: whole blocks by
        reference, the partly filled one copied into the follower's own block."""
        full, partial = divmod(keep, self.block_size)
        own = follower.blocks  # one spare block taken at admission
        shared = leader.blocks[:full]
        self.cache.pool.share(shared)
        follower.blocks = []
        self._append(follower, shared)
        if partial:
            self.cache.copy_block(leader.blocks[full], own[0])
            self._append(follower, own[:1])
            own = own[1:]
        self.cache.pool.release(own)
        follower.fed = keep

    def release(self, seq: Sequence) -> None:
        self.cache.pool.release(seq.blocks)
        seq.blocks = []
        if seq.table_row >= 0:
            self.table[seq.table_row].fill_(NULL_BLOCK)
            self._free_rows.append(seq.table_row)
            seq.table_row = -1

    def _append(self, seq: Sequence, blocks: list[int]) -> None:
        if not blocks:
            return
        start = len(seq.blocks)
        if start + len(blocks) > self.max_blocks:
            raise ValueError(f"a sequence outgrew the model's context ({self.max_blocks} blocks)")
        self.table[seq.table_row, start: start + len(blocks)] = torch.tensor(blocks)
        seq.blocks.extend(blocks)
