"""Where a run's prompts come from (`data.source`): the generated code tasks, a JSONL
file (and its held-out file), or a mixture of domains (`data.mixture`)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from moerl.data.code_tasks import Confusion, make_tasks, noisy_demonstration
from moerl.data.mixture import load_mixture
from moerl.data.prompts import DataConfig, LoadReport, PromptRecord, load_jsonl


def _code_records(count: int, seed: int, prefix: str, sft_fraction: float,
                  constants: list[int] | None, confusion: Confusion | None = None,
                  held_out: bool = False) -> list[PromptRecord]:
    rng = random.Random(seed + 7919)
    return [
        PromptRecord(
            uid=t.uid,
            prompt=t.prompt,
            reward="humaneval",
            spec={"prompt": t.prompt, "test": t.tests, "entry_point": t.entry_point},
            reference=noisy_demonstration(t, rng, sft_fraction, confusion),
        )
        for t in make_tasks(count, seed, prefix, constants, held_out=held_out)
    ]


def load_prompts(cfg: DataConfig, sources: Mapping[str, Any] | None = None,
                 tokens: Callable[[PromptRecord], int] | None = None,
                 ) -> tuple[list[PromptRecord], list[PromptRecord], LoadReport]:
    """(train, eval, report) records for the config. A mixture's domains may name
    `sources` (generators by name) that this package cannot build, e.g. `terminal`;
    their prompts are held to their token limits as `tokens` counts them."""
    if cfg.source == "mixture":
        return load_mixture(cfg, sources or {}, tokens)
    if cfg.source == "code_tasks":
        train = _code_records(cfg.train_size, cfg.seed, "train", cfg.sft_correct_fraction,
                              cfg.constants, cfg.confusion())
        # Another seed and function names no training task has (code_tasks.HELD_OUT_NAMES):
        # no held-out prompt occurs among the SFT rows or RL prompts.
        held_out = _code_records(cfg.eval_size, cfg.seed + 1_000_003, "eval", 1.0,
                                 cfg.constants, held_out=True)
        return train, held_out, LoadReport(loaded=len(train))
    assert cfg.path is not None
    # Bytes are a safe upper bound of tokens for any tokenizer the project ships.
    limit = cfg.max_prompt_tokens * 4
    train, report = load_jsonl(cfg.path, limit, cfg.strict)
    held_out = load_jsonl(cfg.eval_path, limit, cfg.strict)[0] if cfg.eval_path else []
    return train, held_out, report
