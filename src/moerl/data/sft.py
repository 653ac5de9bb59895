"""Instruction data for supervised fine-tuning: (prompt, response) pairs as batches
whose loss falls on the response tokens only.

A row is [BOS] prompt response [EOS] [PAD ...]; labels are the inputs shifted by
one, and the loss mask is 1 exactly where the label is a response token or the
closing EOS, so the model learns to answer and to stop, never to echo prompts.
Rows longer than `seq_length` are an error by default (a silently cut response
teaches the model to stop mid-answer); `truncate=True` cuts and drops the EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moerl.data.synthetic import Batch
from moerl.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class SFTExample:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]


def encode_example(tok: Tokenizer, prompt: str, response: str) -> SFTExample:
    bos = () if tok.bos_id is None else (tok.bos_id,)
    return SFTExample((*bos, *tok.encode(prompt)), (*tok.encode(response), tok.eos_id))


def sft_batch(
    examples: Sequence[SFTExample], seq_length: int, pad_id: int, truncate: bool = False
) -> Batch:
    """A [len(examples), seq_length] batch with next-token labels and response-only loss."""
    rows, masks = [], []
    for i, ex in enumerate(examples):
        ids = list(ex.prompt_ids) + list(ex.response_ids)
        if len(ids) > seq_length + 1:
            if not truncate:
                raise ValueError(
                    f"example {i}: {len(ids)} tokens exceed seq_length + 1 = {seq_length + 1}; "
                    "raise the sequence length or pass truncate=True"
                )
            ids = ids[: seq_length + 1]
        # mask[t] is for label ids[t + 1]: on when that label is a response token.
        first_label = len(ex.prompt_ids) - 1
        mask = [1.0 if t >= first_label else 0.0 for t in range(len(ids) - 1)]
        pad = seq_length + 1 - len(ids)
        rows.append(ids + [pad_id] * pad)
        masks.append(mask + [0.0] * pad)
    seqs = torch.tensor(rows, dtype=torch.int64)  # [b, s + 1]
    positions = torch.arange(seq_length, dtype=torch.int64).expand(len(rows), -1).contiguous()
    return Batch(
        seqs[:, :-1].contiguous(),
        seqs[:, 1:].contiguous(),
        torch.tensor(masks, dtype=torch.float32),
        positions,
    )
