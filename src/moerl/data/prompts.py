"""Prompt datasets for RL: typed records, JSONL loading with row validation, and a
resumable stream.

A record is a prompt plus what the reward server needs to grade a completion of
it (the reward function's name and its spec: tests, expected answer, ...), and
optionally a reference completion for SFT. Malformed rows are counted and
reported, or fail the load with the row number when `strict`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from moerl.data.chat import ChatError, Message, check_messages
from moerl.data.code_tasks import OPERATOR_WORDS, Confusion
from moerl.data.domain_config import DomainConfig, check_mixture


@dataclass(frozen=True)
class PromptRecord:
    uid: str
    prompt: str
    reward: str  # name of the reward function on the reward server
    spec: dict[str, Any] = field(default_factory=dict)
    reference: str | None = None
    messages: list[Message] | None = None
    """A chat row's conversation (the model is prompted through the tokenizer's chat
    template); `prompt` then holds its messages' text, for limits and logs."""
    domain: str = ""
    """The mixture domain it was drawn from (`data.mixture`); "" outside a mixture."""


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the row and the field."""


@dataclass
class DataConfig:
    """The `data` config group."""

    source: Literal["code_tasks", "jsonl", "mixture"] = "code_tasks"
    # mixture: each step's prompts drawn by weight from the domains (data.domains), e.g.
    # {code: 2, math: 1}; domains are selected with the `domain` group (domain=[code,math])
    mixture: dict[str, float] = field(default_factory=dict)
    domains: dict[str, DomainConfig] = field(default_factory=dict)
    path: str | None = None  # jsonl: one {"id", "prompt", "reward", "spec", "reference"?} a line
    eval_path: str | None = None
    train_size: int = 2000  # code_tasks: generated training prompts
    eval_size: int = 64  # code_tasks: held-out prompts (another seed, function names of their own)
    seed: int = 0
    max_prompt_tokens: int = 256  # longer prompts are dropped (counted) or fail when strict
    strict: bool = False
    sft_correct_fraction: float = 0.5  # code_tasks: share of correct SFT demonstrations
    constants: list[int] | None = None  # code_tasks: the tasks' constants; null: 0-9
    # code_tasks: a systematic demonstrator error, operator word -> the word written
    # instead ({times: plus}), on a share `sft_confusion_rate` of those tasks' demonstrations
    sft_confusions: dict[str, str] = field(default_factory=dict)
    sft_confusion_rate: float = 0.6

    def __post_init__(self) -> None:
        if self.source == "mixture":
            check_mixture(self.mixture, self.domains)
        elif self.mixture:
            raise ValueError(f"data.mixture: weights are for data.source=mixture, not "
                             f"data.source={self.source}; set data.source=mixture")
        if self.source == "jsonl" and not self.path:
            raise ValueError("data.path: source=jsonl needs a path to a .jsonl file")
        if not 0.0 <= self.sft_correct_fraction <= 1.0:
            raise ValueError("data.sft_correct_fraction: must be within [0, 1]")
        if self.constants is not None and (
                not self.constants or any(not 0 <= c <= 9 for c in self.constants)):
            raise ValueError("data.constants: a non-empty list of digits 0-9, or null for all")
        words = sorted(OPERATOR_WORDS)
        for word, written in self.sft_confusions.items():
            if word not in OPERATOR_WORDS or written not in OPERATOR_WORDS or word == written:
                raise ValueError(
                    f"data.sft_confusions: {word}: {written} is not a confusion of two "
                    f"different operator words out of {words}, e.g. {{times: plus}}")
        if not 0.0 <= self.sft_confusion_rate <= 1.0:
            raise ValueError("data.sft_confusion_rate: must be within [0, 1]")

    def confusion(self) -> Confusion | None:
        if not self.sft_confusions:
            return None
        return Confusion(dict(self.sft_confusions), self.sft_confusion_rate)


@dataclass
class LoadReport:
    loaded: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1


def json_row(line: str, row: int, required: tuple[tuple[str, type], ...]) -> dict[str, Any]:
    """One JSONL row as an object with the `required` (field, type) pairs; otherwise
    `DatasetError` naming the row and the field."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as err:
        raise DatasetError(f"row {row}: not valid JSON ({err.msg})") from err
    if not isinstance(data, dict):
        raise DatasetError(f"row {row}: expected a JSON object")
    for key, kind in required:
        if not isinstance(data.get(key), kind):
            raise DatasetError(f"row {row}: field {key!r} missing or not a {kind.__name__}")
    return data


def parse_row(line: str, row: int) -> PromptRecord:
    """One JSONL row as a record: {"prompt": str} or {"messages": [...]}, with "reward"
    and "spec"; `DatasetError` naming the row and field otherwise."""
    data = json_row(line, row, (("reward", str), ("spec", dict)))
    messages = None
    if "messages" in data:
        try:
            messages = check_messages(data["messages"], f"row {row}")
        except ChatError as err:
            raise DatasetError(str(err)) from err
        prompt = "\n".join(m["content"] for m in messages)
    elif isinstance(data.get("prompt"), str):
        prompt = data["prompt"]
    else:
        raise DatasetError(f"row {row}: field 'prompt' (a string) or 'messages' (a list) "
                           "is missing")
    reference = data.get("reference")
    if reference is not None and not isinstance(reference, str):
        raise DatasetError(f"row {row}: field 'reference' must be a string")
    uid = str(data.get("id", f"row-{row}"))
    return PromptRecord(uid, prompt, data["reward"], data["spec"], reference, messages)


def load_jsonl(path: str | Path, max_chars: int, strict: bool) -> tuple[list[PromptRecord],
                                                                          LoadReport]:
    report = LoadReport()
    records = []
    for row, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = parse_row(line, row)
            if len(record.prompt) > max_chars:
                raise DatasetError(f"row {row}: prompt longer than the limit ({max_chars})")
        except DatasetError as err:
            if strict:
                raise
            report.drop(str(err).split(": ", 1)[1])
            continue
        records.append(record)
    report.loaded = len(records)
    if not records:
        raise DatasetError(f"{path}: no usable rows ({report.dropped})")
    return records, report


@dataclass
class PromptStream:
    """Epochs over the records in a seeded order; `state()` is all a resume needs.

    Online difficulty filter (`set_aside_epochs` > 0, `rl.difficulty_filter_epochs`): a
    prompt whose last group was settled, every sample solved or every sample failed,
    sits out the next `set_aside_epochs` epochs (`settle`), so samples go where the
    gradient is; it comes back after them. When every prompt is set aside at once the
    stream takes them anyway rather than stall (counted as `exhausted`).
    """

    records: Sequence[PromptRecord]
    seed: int = 0
    position: int = 0
    set_aside_epochs: int = 0
    aside: dict[int, int] = field(default_factory=dict)
    """record index -> the first epoch it is taken again."""
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("solved", "failed", "skipped", "exhausted"), 0))
    _taken: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)
    """id(record) -> (its index, the epoch it was last taken in)."""

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[PromptRecord]:
        out: list[PromptRecord] = []
        skipped_in_a_row = 0
        while len(out) < count:
            epoch, index = divmod(self.position, len(self.records))
            chosen = self._order(epoch)[index]
            self.position += 1
            if self.aside.get(chosen, 0) > epoch:
                skipped_in_a_row += 1
                self.counts["skipped"] += 1
                if skipped_in_a_row < len(self.records):
                    continue
                self.counts["exhausted"] += 1  # all set aside: take it rather than stall
            self.aside.pop(chosen, None)
            skipped_in_a_row = 0
            record = self.records[chosen]
            self._taken[id(record)] = (chosen, epoch)
            out.append(record)
        return out

    def settle(self, record: PromptRecord, rewards: Sequence[float | None]) -> None:
        """The outcome of `record`'s last group: all solved (every reward >= 1) or all
        failed (every reward <= 0) sets it aside; anything else keeps it."""
        valid = [r for r in rewards if r is not None]
        if not self.set_aside_epochs or len(valid) < 2 or id(record) not in self._taken:
            return
        kind = "solved" if min(valid) >= 1.0 else "failed" if max(valid) <= 0.0 else None
        if kind is None:
            return
        index, epoch = self._taken[id(record)]
        self.aside[index] = epoch + 1 + self.set_aside_epochs
        self.counts[kind] += 1

    def metrics(self) -> dict[str, float]:
        if not self.set_aside_epochs:
            return {}
        return {"data/set_aside": float(len(self.aside)),
                **{f"data/{k}_total": float(v) for k, v in self.counts.items()}}

    def __iter__(self) -> Iterator[PromptRecord]:
        while True:
            yield from self.take(1)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the position, what the order depends on, and with the
        difficulty filter on, the prompts set aside."""
        state: dict[str, Any] = {"position": self.position, "seed": self.seed,
                                 "size": len(self.records)}
        if self.set_aside_epochs:
            state["aside"] = {str(k): v for k, v in self.aside.items()}
            state["counts"] = dict(self.counts)
        return state

    def restore(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue where `state()` was taken. With `strict`, a stream over another
        number of records or another order seed is refused: the position would point
        into a different order."""
        position = state.get("position")
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise DatasetError(f"prompt stream state: 'position' must be an int >= 0, "
                               f"got {position!r}")
        if strict:
            for key, ours in (("seed", self.seed), ("size", len(self.records))):
                if state.get(key) != ours:
                    raise DatasetError(
                        f"prompt stream state: saved {key} {state.get(key)!r} != this run's "
                        f"{ours} (data.seed or the dataset changed); the saved position does "
                        "not apply to this order"
                    )
        self.position = position
        self.aside = {int(k): int(v) for k, v in (state.get("aside") or {}).items()
                      if 0 <= int(k) < len(self.records)}
        self.counts.update({k: int(v) for k, v in (state.get("counts") or {}).items()
                            if k in self.counts})
