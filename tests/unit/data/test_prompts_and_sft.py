"""Prompt datasets (row validation, resumable stream) and SFT batches (loss on the
response only, next-token alignment)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moerl.data.prompt_sources import load_prompts
from moerl.data.prompts import DataConfig, DatasetError, PromptStream
from moerl.data.sft import encode_example, sft_batch
from moerl.data.tokenizer import ByteTokenizer


def _write(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(rows) + "\n")
    return path


GOOD = json.dumps({"id": "a", "prompt": "2+2=", "reward": "math", "spec": {"answer": "4"}})


def test_malformed_rows_are_counted_or_fatal_when_strict(tmp_path: Path) -> None:
    rows = [GOOD, "{not json", json.dumps({"prompt": "x", "reward": "math"}),
            json.dumps({"prompt": "y" * 5000, "reward": "math", "spec": {}}), "[1, 2]"]
    path = _write(tmp_path / "d.jsonl", rows)
    train, _, report = load_prompts(DataConfig(source="jsonl", path=str(path)))
    assert [r.uid for r in train] == ["a"]
    assert sum(report.dropped.values()) == 4
    assert any("spec" in why for why in report.dropped)
    with pytest.raises(DatasetError, match="row 2: not valid JSON"):
        load_prompts(DataConfig(source="jsonl", path=str(path), strict=True))


def test_no_usable_rows_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", ["{}"])
    with pytest.raises(DatasetError, match="no usable rows"):
        load_prompts(DataConfig(source="jsonl", path=str(path)))


def test_jsonl_source_needs_a_path() -> None:
    with pytest.raises(ValueError, match=r"data\.path"):
        DataConfig(source="jsonl")


def test_code_tasks_split_train_and_held_out() -> None:
    train, held_out, _ = load_prompts(DataConfig(train_size=20, eval_size=10))
    assert len(train) == 20 and len(held_out) == 10
    assert {r.uid.split("-")[0] for r in held_out} == {"eval"}
    assert all(r.reward == "humaneval" and r.spec["entry_point"] for r in train)


def test_prompt_stream_resumes_at_its_position() -> None:
    train, _, _ = load_prompts(DataConfig(train_size=7))
    first = PromptStream(train, seed=3)
    head = first.take(10)
    rest = first.take(5)
    resumed = PromptStream(train, seed=3, position=10)
    assert resumed.take(5) == rest
    assert {r.uid for r in head[:7]} == {r.uid for r in train}  # an epoch sees every row


def test_sft_batch_masks_the_response_only() -> None:
    tok = ByteTokenizer()
    ex = encode_example(tok, "ab", "cd")  # [BOS a b] [c d EOS]
    batch = sft_batch([ex], seq_length=8, pad_id=tok.PAD)
    tokens, labels, mask = batch.tokens[0].tolist(), batch.labels[0].tolist(), batch.loss_mask[0]
    assert tokens[:5] == [tok.BOS, *b"abcd"]
    assert labels[:5] == [*b"abcd", tok.EOS]
    # labels c, d and EOS carry loss; a, b (prompt) and padding do not
    assert mask.tolist() == [0, 0, 1, 1, 1, 0, 0, 0]


def test_sft_batch_refuses_silent_truncation() -> None:
    tok = ByteTokenizer()
    ex = encode_example(tok, "a" * 10, "b" * 10)
    with pytest.raises(ValueError, match="seq_length"):
        sft_batch([ex], seq_length=8, pad_id=tok.PAD)
    assert sft_batch([ex], seq_length=8, pad_id=tok.PAD, truncate=True).tokens.shape == (1, 8)
