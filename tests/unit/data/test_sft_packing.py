"""Packing SFT examples into rows: boundaries, masks and positions; JSONL instruction data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moerl.data.sft import (
    SFTDataError,
    SFTExample,
    encode_example,
    load_sft_jsonl,
    pack_examples,
    packed_batch,
    sft_batch,
)
from moerl.data.tokenizer import ByteTokenizer
from moerl.parallel.layout import ParallelLayout
from moerl.trainer.config import SFTConfig

TOK = ByteTokenizer()


def _examples() -> list[SFTExample]:
    pairs = [("ab", "cd"), ("hello", "w"), ("x", "yz!"), ("long prompt", "and answer")]
    return [encode_example(TOK, p, r) for p, r in pairs]


def test_first_fit_keeps_every_example_once_within_the_row_length() -> None:
    examples = _examples()  # slots (tokens - 1): 5, 7, 5, 22
    rows = pack_examples(examples, seq_length=22)
    assert sorted(i for row in rows for i in row) == list(range(len(examples)))
    for row in rows:
        used = sum(len(examples[i].prompt_ids) + len(examples[i].response_ids) - 1 for i in row)
        assert used <= 22
    assert rows == [[0, 1, 2], [3]]  # the long one does not fit the first row's 5 free slots


def test_an_example_longer_than_a_row_is_refused_by_index() -> None:
    with pytest.raises(ValueError, match=r"example 3: 23 tokens exceed sft.seq_length \+ 1 = 22"):
        pack_examples(_examples(), seq_length=21)


def test_each_packed_document_equals_its_own_unpacked_row() -> None:
    examples = _examples()[:3]
    packed = packed_batch([examples], seq_length=20, pad_id=TOK.PAD)
    alone = sft_batch(examples, seq_length=20, pad_id=TOK.PAD)
    cu = packed.cu_seqlens
    assert cu is not None and cu.tolist() == [[0, 5, 12, 17, 20]]  # padding: its own document
    for d in range(3):
        start, end = int(cu[0, d]), int(cu[0, d + 1])
        n = end - start
        assert torch.equal(packed.tokens[0, start:end], alone.tokens[d, :n])
        assert torch.equal(packed.labels[0, start:end], alone.labels[d, :n])
        assert torch.equal(packed.loss_mask[0, start:end], alone.loss_mask[d, :n])
        assert packed.position_ids[0, start:end].tolist() == list(range(n))
    assert packed.loss_mask.sum() == alone.loss_mask.sum()
    assert packed.loss_mask[0, 17:].sum() == 0


def test_rows_with_different_document_counts_share_one_boundary_tensor() -> None:
    ex = _examples()
    batch = packed_batch([[ex[0], ex[1]], [ex[3]]], seq_length=22, pad_id=TOK.PAD)
    assert batch.cu_seqlens is not None
    assert batch.cu_seqlens.tolist() == [[0, 5, 12, 22], [0, 22, 22, 22]]
    assert batch.tokens.shape == (2, 22)


def test_jsonl_instruction_rows_and_errors_naming_row_and_field(tmp_path: Path) -> None:
    good = tmp_path / "sft.jsonl"
    good.write_text(json.dumps({"prompt": "q", "response": "a"}) + "\n\n"
                    + json.dumps({"prompt": "", "response": "b", "extra": 1}) + "\n")
    assert load_sft_jsonl(good) == [("q", "a"), ("", "b")]
    for line, message in (
        ('{"prompt": "q"}', "row 1: field 'response' missing"),
        ('{"prompt": 3, "response": "a"}', "row 1: field 'prompt' missing or not a str"),
        ('{"prompt": "q", "response": ""}', "row 1: field 'response' is empty"),
        ("[1]", "row 1: expected a JSON object"),
        ("{oops", "row 1: not valid JSON"),
    ):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(line + "\n")
        with pytest.raises(SFTDataError, match=message):
            load_sft_jsonl(bad)
    with pytest.raises(SFTDataError, match=r"sft.data_path: .* is not a file"):
        load_sft_jsonl(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    ("sft", "layout", "mtp", "message"),
    [
        (SFTConfig(global_batch=8, micro_batch=4), ParallelLayout(dp=4), 0, "sft.global_batch"),
        (SFTConfig(seq_length=90), ParallelLayout(cp=2, dp=1), 0, "sft.seq_length: 90 .* of 4"),
        (SFTConfig(seq_length=100), ParallelLayout(tp=2, cp=2, dp=1), 0, "multiple of 8"),
        (SFTConfig(pack=True), ParallelLayout(cp=2, dp=1), 1, "sft.pack: multi-token"),
    ],
)
def test_sft_batch_shape_rules_name_the_field(
    sft: SFTConfig, layout: ParallelLayout, mtp: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        sft.check_layout(layout, mtp)
    SFTConfig(global_batch=8, micro_batch=2, seq_length=96).check_layout(layout, 0)
