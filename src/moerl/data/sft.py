"""Instruction data for supervised fine-tuning: (prompt, response) pairs as batches
whose loss falls on the response tokens only.

A row is [BOS] prompt response [EOS] [PAD ...]; labels are the inputs shifted by
one, and the loss mask is 1 exactly where the label is a response token or the
closing EOS, so the model learns to answer and to stop, never to echo prompts.
Rows longer than `seq_length` are an error by default (a silently cut response
teaches the model to stop mid-answer); `truncate=True` cuts and drops the EOS.

Packed rows (`pack_examples`, `packed_batch`): several examples share one row, each
exactly as it would be alone (its tokens without the final EOS as inputs, its
labels inside itself), with the row's document boundaries in `Batch.cu_seqlens` so
attention stays inside each example and positions restart at 0. Summed over its
loss tokens, a packed micro-batch gives the same loss as the unpacked one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moerl.data.chat import (
    ChatError,
    Message,
    check_messages,
    encode_chat_turns,
    encode_prompt,
)
from moerl.data.prompts import DatasetError, PromptRecord, json_row
from moerl.data.synthetic import Batch
from moerl.data.tokenizer import Tokenizer
from moerl.parallel.context import packed_position_ids


@dataclass(frozen=True)
class SFTExample:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response_mask: tuple[int, ...] | None = None
    """Which response tokens carry the loss (a conversation's non-assistant turns do
    not); None: all of them."""

    def label_mask(self) -> list[float]:
        """The loss mask of labels 1..n-1 (label t is token t + 1): response tokens
        that carry the loss."""
        first_label = len(self.prompt_ids) - 1
        trained = self.response_mask or (1,) * len(self.response_ids)
        return [0.0] * first_label + [float(m) for m in trained]


def encode_example(tok: Tokenizer, prompt: str, response: str) -> SFTExample:
    bos = () if tok.bos_id is None else (tok.bos_id,)
    return SFTExample((*bos, *tok.encode(prompt)), (*tok.encode(response), tok.eos_id))


def encode_conversation(tok: Tokenizer, messages: list[Message], where: str) -> SFTExample:
    """A chat row rendered by the tokenizer's template, the loss on assistant turns."""
    prompt, rest, mask = encode_chat_turns(tok, messages, where)
    return SFTExample(tuple(prompt), tuple(rest), tuple(mask))


class SFTDataError(ValueError):
    """Instruction data that cannot be used; the message names the row and the field."""


def load_sft_jsonl(path: str | Path) -> list[tuple[str, str] | list[Message]]:
    """Rows of `sft.data_path`: (prompt, response) pairs from {"prompt", "response"}
    rows, or conversations from {"messages": [...]} rows."""
    source = Path(path)
    if not source.is_file():
        raise SFTDataError(f"sft.data_path: {source} is not a file")
    rows: list[tuple[str, str] | list[Message]] = []
    for row, line in enumerate(source.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json_row(line, row, ())
            if "messages" in data:
                rows.append(check_messages(data["messages"], f"row {row}"))
                continue
            data = json_row(line, row, (("prompt", str), ("response", str)))
        except (DatasetError, ChatError) as err:
            raise SFTDataError(f"{source} {err}") from err
        if not data["response"]:
            raise SFTDataError(f"{source} row {row}: field 'response' is empty")
        rows.append((data["prompt"], data["response"]))
    if not rows:
        raise SFTDataError(f"{source}: no rows")
    return rows


def instruction_examples(
    tok: Tokenizer, data_path: str | None, records: Sequence[PromptRecord]
) -> list[SFTExample]:
    """The examples of `sft.data_path`, or else the records' reference completions."""
    if data_path is not None:
        try:
            return [encode_conversation(tok, row, f"{data_path} row {i}") if isinstance(row, list)
                    else encode_example(tok, *row)
                    for i, row in enumerate(load_sft_jsonl(data_path), start=1)]
        except ChatError as err:
            raise SFTDataError(str(err)) from err
    examples = [SFTExample(tuple(encode_prompt(tok, r.prompt, r.messages)),
                           (*tok.encode(r.reference), tok.eos_id))
                for r in records if r.reference]
    if not examples:
        raise SFTDataError(
            "sft: the data group's prompts have no reference completions; set sft.data_path "
            "to a JSONL of {\"prompt\", \"response\"} rows"
        )
    return examples


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
        # mask[t] is for label ids[t + 1]: on when that label is a trained response token.
        mask = ex.label_mask()[: len(ids) - 1]
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


def row_slots(ex: SFTExample) -> int:
    """Positions an example takes in a row: all its tokens but the last (an input
    whose label would lie outside the example)."""
    return len(ex.prompt_ids) + len(ex.response_ids) - 1


def pack_examples(examples: Sequence[SFTExample], seq_length: int) -> list[list[int]]:
    """Indices of `examples` grouped into rows of at most `seq_length` positions.

    First fit in the given order: each example goes to the first open row with room,
    so rows fill densely and the order is kept roughly. An example longer than a row
    is an error naming it.
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i, ex in enumerate(examples):
        need = row_slots(ex)
        if need > seq_length:
            raise ValueError(
                f"example {i}: {need + 1} tokens exceed sft.seq_length + 1 = {seq_length + 1}; "
                "raise sft.seq_length"
            )
        for r, free in enumerate(room):
            if free >= need:
                rows[r].append(i)
                room[r] -= need
                break
        else:
            rows.append([i])
            room.append(seq_length - need)
    return rows


def packed_batch(rows: Sequence[Sequence[SFTExample]], seq_length: int, pad_id: int) -> Batch:
    """A [len(rows), seq_length] batch of packed rows with their document boundaries.

    The padding after a row's last example is one more (masked) document, so
    `cu_seqlens` [b, max_docs + 1] ends at `seq_length` in every row.
    """
    tokens, labels, masks, bounds = [], [], [], []
    for r, row in enumerate(rows):
        ids: list[int] = []
        targets: list[int] = []
        mask: list[float] = []
        ends = [0]
        for ex in row:
            seq = list(ex.prompt_ids) + list(ex.response_ids)
            ids += seq[:-1]
            targets += seq[1:]
            mask += ex.label_mask()
            ends.append(len(ids))
        if len(ids) > seq_length:
            raise ValueError(f"packed row {r}: {len(ids)} positions exceed {seq_length}")
        pad = seq_length - len(ids)
        if pad:
            ends.append(seq_length)
        tokens.append(ids + [pad_id] * pad)
        labels.append(targets + [pad_id] * pad)
        masks.append(mask + [0.0] * pad)
        bounds.append(ends)
    width = max(len(b) for b in bounds)
    cu = torch.tensor([b + [seq_length] * (width - len(b)) for b in bounds], dtype=torch.int32)
    return Batch(
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(labels, dtype=torch.int64),
        torch.tensor(masks, dtype=torch.float32),
        packed_position_ids(cu, seq_length),
        cu,
    )
