"""Policy-gradient objectives, one per module, and the factory that builds them by name.

    objective = build_objective("dapo", DAPOConfig(eps_high=0.28))
    loss, metrics = objective(PolicyLossInputs(...), denom)   # per micro-batch

`denom` is the global-batch Denominator (aggregation.global_denominator); see
protocol.py for what loss and metrics mean across micro-batches and ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moerl.rl.losses.aggregation import (
    AggregationMode,
    Denominator,
    aggregate,
    global_denominator,
)
from moerl.rl.losses.cispo import CISPO, CISPOConfig
from moerl.rl.losses.dapo import DAPO, DAPOConfig
from moerl.rl.losses.dr_grpo import DrGRPO, DrGRPOConfig
from moerl.rl.losses.grpo import GRPO, GRPOConfig
from moerl.rl.losses.gspo import GSPO, GSPOConfig
from moerl.rl.losses.is_correction import ISCorrectionConfig, ISLevel, ISMode
from moerl.rl.losses.kl import KLEstimator
from moerl.rl.losses.ppo_clip import PPOClip, PPOClipConfig
from moerl.rl.losses.protocol import Metrics, PolicyLossInputs, PolicyObjective
from moerl.rl.losses.terms import ObjectiveConfig


@dataclass(frozen=True)
class _Entry:
    config_cls: type[ObjectiveConfig]
    build: Callable[[Any], PolicyObjective]


# Each builder takes exactly its own config class (checked in build_objective).
_REGISTRY: dict[str, _Entry] = {
    "ppo_clip": _Entry(PPOClipConfig, PPOClip),
    "grpo": _Entry(GRPOConfig, GRPO),
    "dapo": _Entry(DAPOConfig, DAPO),
    "gspo": _Entry(GSPOConfig, GSPO),
    "cispo": _Entry(CISPOConfig, CISPO),
    "dr_grpo": _Entry(DrGRPOConfig, DrGRPO),
}

OBJECTIVE_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def objective_config_class(name: str) -> type[ObjectiveConfig]:
    """The config dataclass of objective `name`, for building it from YAML values."""
    return _entry(name).config_cls


def build_objective(name: str, cfg: ObjectiveConfig | None = None) -> PolicyObjective:
    """The objective `name` with `cfg` (its own config class), or its defaults if None."""
    entry = _entry(name)
    if cfg is None:
        cfg = entry.config_cls()
    elif type(cfg) is not entry.config_cls:
        raise TypeError(
            f"objective {name!r} takes {entry.config_cls.__name__}, got {type(cfg).__name__}"
        )
    return entry.build(cfg)


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVE_NAMES)}"
        ) from None


__all__ = [
    "CISPO",
    "DAPO",
    "GRPO",
    "GSPO",
    "OBJECTIVE_NAMES",
    "AggregationMode",
    "CISPOConfig",
    "DAPOConfig",
    "Denominator",
    "DrGRPO",
    "DrGRPOConfig",
    "GRPOConfig",
    "GSPOConfig",
    "ISCorrectionConfig",
    "ISLevel",
    "ISMode",
    "KLEstimator",
    "Metrics",
    "ObjectiveConfig",
    "PPOClip",
    "PPOClipConfig",
    "PolicyLossInputs",
    "PolicyObjective",
    "aggregate",
    "build_objective",
    "global_denominator",
    "objective_config_class",
]
