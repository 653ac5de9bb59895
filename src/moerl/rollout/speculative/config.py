"""How speculative decoding is configured, and the per-sample draft length schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SpeculativeMode = Literal["none", "ngram", "mtp"]
SPECULATIVE_MODES: tuple[str, ...] = ("none", "ngram", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """The engine's speculative decoding settings.

    `num_draft_tokens` drafts are proposed per sample and step; with `adaptive`
    that is only the starting length, which then moves within
    [`min_draft_tokens`, `max_draft_tokens`] with each sample's acceptance.
    """

    mode: SpeculativeMode = "none"
    num_draft_tokens: int = 4
    adaptive: bool = False
    min_draft_tokens: int = 1
    max_draft_tokens: int = 8
    ngram_max: int = 4  # longest suffix n-gram looked up in the context
    ngram_min: int = 2  # shortest; 1 matches too easily to be worth a draft

    def __post_init__(self) -> None:
        if self.mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative.mode must be one of {SPECULATIVE_MODES}, "
                             f"got {self.mode!r}")
        if not 1 <= self.min_draft_tokens <= self.max_draft_tokens:
            raise ValueError("speculative: need 1 <= min_draft_tokens <= max_draft_tokens")
        if not self.min_draft_tokens <= self.num_draft_tokens <= self.max_draft_tokens:
            raise ValueError("speculative.num_draft_tokens must lie in "
                             "[min_draft_tokens, max_draft_tokens]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("speculative: need 1 <= ngram_min <= ngram_max")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def longest(self) -> int:
        """The most drafts one step can hold for a sample."""
        return self.max_draft_tokens if self.adaptive else self.num_draft_tokens


@dataclass
class DraftLength:
    """One sample's number of drafts per step.

    Fixed unless `adaptive`: then one more after a step that accepted every draft,
    one fewer after a step that accepted fewer than half (the usual heuristic: a
    rejected draft costs a wasted position in the window, an accepted one saves a
    forward step).
    """

    config: SpeculativeConfig
    current: int = 0

    def __post_init__(self) -> None:
        self.current = self.config.num_draft_tokens

    def update(self, drafted: int, accepted: int) -> None:
        if not self.config.adaptive or drafted == 0:
            return
        if accepted == drafted:
            self.current = min(self.current + 1, self.config.max_draft_tokens)
        elif 2 * accepted < drafted:
            self.current = max(self.current - 1, self.config.min_draft_tokens)
