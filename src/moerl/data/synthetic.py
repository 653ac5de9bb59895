"""A tiny deterministic corpus with structure a small model learns in a few dozen steps.

Each sample is an arithmetic sequence modulo the vocabulary: a random start and a
stride drawn from a small set, `x[t+1] = (x[t] + stride) % vocab`. After two tokens
the rest is determined, so the loss falls from ln(vocab) towards the cost of
guessing the first two tokens. Sample `i` depends only on (seed, i), so any data
parallel split of a global batch sees exactly the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

STRIDES = (1, 2, 3, 5, 7)


@dataclass(frozen=True)
class Batch:
    """One micro-batch; every tensor but `cu_seqlens` is [micro_batch, seq_length]."""

    tokens: torch.Tensor  # int64 inputs
    labels: torch.Tensor  # int64 next tokens
    loss_mask: torch.Tensor  # float32, 1 where the label counts
    position_ids: torch.Tensor  # int64, 0..seq_length-1
    cu_seqlens: torch.Tensor | None = None
    """Packed rows: int32 [micro_batch, n + 1] document boundaries of each whole row
    (0, end of document 0, ..., seq_length; right-padded with seq_length). Tokens
    attend only within their document; the label of a document's last token belongs
    to the next document and must be masked. Not split under context parallelism."""

    def to(self, device: torch.device) -> Batch:
        cu = None if self.cu_seqlens is None else self.cu_seqlens.to(device)
        return Batch(self.tokens.to(device), self.labels.to(device),
                     self.loss_mask.to(device), self.position_ids.to(device), cu)


@dataclass(frozen=True)
class SyntheticCorpus:
    vocab_size: int
    seq_length: int
    seed: int = 0

    def sample(self, index: int) -> torch.Tensor:
        """Sample `index` as [seq_length + 1] token ids."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab_size, (1,), generator=gen))
        stride = STRIDES[int(torch.randint(len(STRIDES), (1,), generator=gen))]
        steps = torch.arange(self.seq_length + 1, dtype=torch.int64)
        return (start + stride * steps) % self.vocab_size

    def batch(self, first: int, size: int) -> Batch:
        """Samples first .. first + size - 1 as one micro-batch."""
        seqs = torch.stack([self.sample(first + i) for i in range(size)])  # [b, s + 1]
        tokens, labels = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
        positions = torch.arange(self.seq_length, dtype=torch.int64).expand(size, -1)
        return Batch(tokens, labels, torch.ones(size, self.seq_length), positions.contiguous())


def step_batches(
    corpus: SyntheticCorpus,
    step: int,
    *,
    global_batch: int,
    micro_batch: int,
    dp_rank: int,
    dp_size: int,
) -> Iterator[Batch]:
    """This data-parallel rank's micro-batches of optimizer step `step`.

    The global batch is samples [step * global_batch, (step + 1) * global_batch);
    rank r takes the r-th contiguous block of global_batch / dp_size samples.
    """
    per_rank = global_batch // dp_size
    if per_rank * dp_size != global_batch or per_rank % micro_batch:
        raise ValueError(
            f"global_batch {global_batch} must split into dp={dp_size} ranks x "
            f"micro-batches of {micro_batch}"
        )
    first = step * global_batch + dp_rank * per_rank
    for offset in range(0, per_rank, micro_batch):
        yield corpus.batch(first + offset, micro_batch)
