"""Policy-gradient objectives, one per module, and the factory that builds them by name.

    objective = build_objective("dapo", DAPOConfig(eps_high=0.28))
    loss, metrics = objective(PolicyLossInputs(...), denom)   # per micro-batch

`denom` is the global-batch Denominator (aggregation.global_denominator); see
protocol.py for what loss and metrics mean across micro-batches and ranks. The names and
config classes come from moerl.rl.objective_config, which reads configs without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moerl.rl.losses.aggregation import Denominator, aggregate, global_denominator
from moerl.rl.losses.cispo import CISPO
from moerl.rl.losses.dapo import DAPO
from moerl.rl.losses.dr_grpo import DrGRPO
from moerl.rl.losses.grpo import GRPO
from moerl.rl.losses.gspo import GSPO
from moerl.rl.losses.ppo_clip import PPOClip
from moerl.rl.losses.protocol import Metrics, PolicyLossInputs, PolicyObjective
from moerl.rl.objective_config import (
    OBJECTIVE_NAMES,
    AggregationMode,
    CISPOConfig,
    DAPOConfig,
    DrGRPOConfig,
    GRPOConfig,
    GSPOConfig,
    ISCorrectionConfig,
    ISLevel,
    ISMode,
    KLEstimator,
    ObjectiveConfig,
    PPOClipConfig,
    objective_config_class,
)

# Keyed by config class: the names are listed once, in objective_config.OBJECTIVE_CONFIGS.
# Each builder takes exactly its own config class (checked in build_objective).
_BUILDERS: dict[type[ObjectiveConfig], Callable[[Any], PolicyObjective]] = {
    PPOClipConfig: PPOClip,
    GRPOConfig: GRPO,
    DAPOConfig: DAPO,
    GSPOConfig: GSPO,
    CISPOConfig: CISPO,
    DrGRPOConfig: DrGRPO,
}


def build_objective(name: str, cfg: ObjectiveConfig | None = None) -> PolicyObjective:
    """The objective `name` with `cfg` (its own config class), or its defaults if None."""
    config_cls = objective_config_class(name)
    if cfg is None:
        cfg = config_cls()
    elif type(cfg) is not config_cls:
        raise TypeError(
            f"objective {name!r} takes {config_cls.__name__}, got {type(cfg).__name__}"
        )
    return _BUILDERS[config_cls](cfg)


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
