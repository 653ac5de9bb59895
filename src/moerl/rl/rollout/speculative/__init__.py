"""Speculative decoding for the rollout engine: drafters, exact verification, metrics."""

from moerl.rl.rollout.speculative.config import DraftLength, SpeculativeConfig, SpeculativeMode
from moerl.rl.rollout.speculative.drafters import (
    Draft,
    Drafter,
    DraftRequest,
    MTPDrafter,
    NgramDrafter,
    make_drafter,
)
from moerl.rl.rollout.speculative.metrics import speculation_metrics

__all__ = [
    "Draft",
    "DraftLength",
    "DraftRequest",
    "Drafter",
    "MTPDrafter",
    "NgramDrafter",
    "SpeculativeConfig",
    "SpeculativeMode",
    "make_drafter",
    "speculation_metrics",
]
