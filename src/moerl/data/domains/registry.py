"""Domains by name: the shipped generators, JSONL files, and a user's generators by
import path; each domain's training and held-out records, tagged with its name."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from moerl.data.domain_config import DomainConfig
from moerl.data.domains import Generator
from moerl.data.prompts import DatasetError, LoadReport, PromptRecord, load_jsonl

SHIPPED_GENERATORS: dict[str, str] = {
    "code": "moerl.data.domains.code:generate",
    "programs": "moerl.data.domains.programs:generate",
    "math": "moerl.data.domains.math_problems:generate",
    "documents": "moerl.data.domains.documents:generate",
    "tools": "moerl.data.domains.tools:generate",
}

PromptTokens = Callable[[PromptRecord], int]
"""A prompt's length in tokens as the run's tokenizer encodes it."""

HELD_OUT_SEED_OFFSET = 1_000_003
"""A held-out set is generated from seed + this: other tasks than training's."""


def load_generator(source: str, where: str) -> Generator:
    """The generator a domain's `source` names: a shipped one or 'package.module:attr'."""
    path = SHIPPED_GENERATORS.get(source, source)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise DatasetError(f"{where}: cannot import {module_name!r} ({err})") from err
    found = getattr(module, attr, None)
    if not callable(found):
        raise DatasetError(f"{where}: {module_name!r} has no function {attr!r}")
    generator: Generator = found
    return generator


@dataclass
class DomainRecords:
    name: str
    train: list[PromptRecord]
    held_out: list[PromptRecord]
    report: LoadReport


def _tag(records: list[PromptRecord], name: str, reward: str | None) -> list[PromptRecord]:
    return [replace(r, uid=f"{name}/{r.uid}", domain=name, reward=reward or r.reward)
            for r in records]


def _within(records: list[PromptRecord], limit: int, tokens: PromptTokens, strict: bool,
            where: str, report: LoadReport) -> list[PromptRecord]:
    kept = []
    for record in records:
        if tokens(record) <= limit:
            kept.append(record)
        elif strict:
            raise DatasetError(f"{where}: prompt {record.uid} is longer than {limit} tokens; "
                               "raise max_prompt_tokens or shorten the prompts (options)")
        else:
            report.drop("prompt longer than max_prompt_tokens")
    return kept


def _unseen(held_out: list[PromptRecord], train: list[PromptRecord],
            report: LoadReport) -> list[PromptRecord]:
    """The held-out records whose prompt text no training record has: a generator with a
    small space (or two JSONL files that share rows) would otherwise measure the model
    on prompts it trained on. Each one left out is counted in the report."""
    seen = {record.prompt for record in train}
    kept = [record for record in held_out if record.prompt not in seen]
    for _ in range(len(held_out) - len(kept)):
        report.drop("held-out prompt also a training prompt")
    return kept


def bytes_upper_bound(record: PromptRecord) -> int:
    """A prompt's length in tokens when no tokenizer is at hand: its UTF-8 bytes, an
    upper bound for every tokenizer the project ships (the byte tokenizer's count)."""
    return len(record.prompt.encode())


def domain_records(name: str, cfg: DomainConfig, data_seed: int, max_prompt_tokens: int,
                   strict: bool, sources: Mapping[str, Generator],
                   tokens: PromptTokens = bytes_upper_bound) -> DomainRecords:
    """The domain's records, each prompt within the domain's `max_prompt_tokens` as
    `tokens` counts it (the run's tokenizer); `sources` supplies what this package
    cannot build itself (the `terminal` domain's tasks)."""
    where = f"data.domains.{name}"
    seed = data_seed if cfg.seed is None else cfg.seed
    limit = cfg.max_prompt_tokens or max_prompt_tokens
    report = LoadReport()
    if cfg.source == "terminal":  # episodes: bounded by rl.agent's token limits instead
        tokens, limit = (lambda record: 0), 0
    if cfg.source == "jsonl":
        assert cfg.path is not None
        train, report = load_jsonl(cfg.path, 4 * limit, strict)
        held_out = (load_jsonl(cfg.eval_path, 4 * limit, strict)[0][: cfg.eval_size]
                    if cfg.eval_path else [])
        train = _within(train, limit, tokens, strict, where, report)
        held_out = _within(held_out, limit, tokens, strict, where, report)
    else:
        generator = sources.get(cfg.source) or load_generator(cfg.source, f"{where}.source")
        try:
            train = generator(cfg.train_size, seed, "train", cfg.options)
            held_out = (generator(cfg.eval_size, seed + HELD_OUT_SEED_OFFSET, "eval",
                                  cfg.options) if cfg.eval_size else [])
        except ValueError as err:
            raise DatasetError(f"{where}.{err}" if str(err).startswith("options.")
                               else f"{where}: {err}") from err
        train = _within(train, limit, tokens, strict, where, report)
        held_out = _within(held_out, limit, tokens, strict, where, report)
    held_out = _unseen(held_out, train, report)
    if not train:
        raise DatasetError(f"{where}: no training prompts ({report.dropped or 'none made'})")
    report.loaded = len(train)
    return DomainRecords(name, _tag(train, name, cfg.reward), _tag(held_out, name, cfg.reward),
                         report)
