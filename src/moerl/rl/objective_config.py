"""The configs of the policy-gradient objectives, and their names.

They live apart from the objectives so that reading and checking a run's config costs
nothing: this module imports neither torch nor Megatron, while `moerl.rl.losses`
imports both its objectives and torch. Each objective's formula, and what its fields
mean in it, stays in its own module in rl/losses/ (ppo_clip.py, grpo.py, ...); the
objectives themselves are built by `moerl.rl.losses.build_objective`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class AggregationMode(StrEnum):
    """How per-token losses become a scalar; the formulas are in rl/losses/aggregation.py."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


class KLEstimator(StrEnum):
    """Per-token estimators of KL(pi || pi_ref); see rl/losses/kl.py."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class ISMode(StrEnum):
    """Truncate or mask the rollout/trainer IS weight; see rl/losses/is_correction.py."""

    TRUNCATE = "tis"
    MASK = "mis"


class ISLevel(StrEnum):
    """Which tokens share one IS weight; see rl/losses/is_correction.py."""

    TOKEN = "token"
    SEQUENCE = "sequence"
    GEOMETRIC = "geometric"


@dataclass(frozen=True)
class ISCorrectionConfig:
    mode: ISMode = ISMode.TRUNCATE
    level: ISLevel = ISLevel.TOKEN
    upper: float = 2.0
    """TIS: truncation threshold C; MIS: largest weight kept."""
    lower: float = 0.0
    """MIS only: smallest weight kept (0 keeps every weight below `upper`)."""
    log_clamp: float = 20.0
    """Bound on the summed log-ratio before exp, so long sequences cannot overflow."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", ISMode(self.mode))
        object.__setattr__(self, "level", ISLevel(self.level))
        if not 0.0 <= self.lower < self.upper:
            raise ValueError(f"need 0 <= lower < upper, got lower={self.lower} upper={self.upper}")


@dataclass(frozen=True)
class ObjectiveConfig:
    """Fields every objective has; each objective's config extends it."""

    aggregation: AggregationMode = AggregationMode.TOKEN_MEAN
    """How per-token losses become a scalar; see rl/losses/aggregation.py."""
    kl_coef: float = 0.0
    """beta of the KL-to-reference loss term; 0 disables it (ref logprobs not needed)."""
    kl_estimator: KLEstimator = KLEstimator.K3
    entropy_coef: float = 0.0
    """c of the entropy bonus; 0 disables it (entropy still reported when given)."""
    is_correction: ISCorrectionConfig | None = None
    """Rollout-vs-trainer importance correction; None disables it."""
    norm_len: float | None = None
    """L of seq-mean-token-sum-norm (Dr.GRPO's constant, the maximum response length);
    only that aggregation reads it. None there: the run's longest response (the rl group
    fills it in from rl.sampling.max_tokens)."""

    def __post_init__(self) -> None:
        # Hydra hands strings; keep the fields typed as enums from here on.
        object.__setattr__(self, "aggregation", AggregationMode(self.aggregation))
        object.__setattr__(self, "kl_estimator", KLEstimator(self.kl_estimator))
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(
                f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}"
            )
        if self.norm_len is not None:
            if self.norm_len <= 0:
                raise ValueError(f"norm_len must be > 0, got {self.norm_len}")
            if self.aggregation is not AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM:
                raise ValueError(
                    f"norm_len={self.norm_len} with aggregation {self.aggregation.value}: only "
                    f"{AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM.value} divides by it; remove "
                    "norm_len or set that aggregation")


def check_clip_range(eps_low: float, eps_high: float) -> None:
    """A ratio clip range [1 - eps_low, 1 + eps_high] must contain 1 and stay >= 0."""
    if not (0.0 <= eps_low <= 1.0 and eps_high >= 0.0):
        raise ValueError(f"need 0 <= eps_low <= 1 and eps_high >= 0; got {eps_low}, {eps_high}")


@dataclass(frozen=True)
class PPOClipConfig(ObjectiveConfig):
    """PPO-clip with optional dual clip; see rl/losses/ppo_clip.py."""

    eps_low: float = 0.2
    """Lower clip: the ratio is held at >= 1 - eps_low for negative advantages."""
    eps_high: float = 0.2
    """Upper clip: the ratio is held at <= 1 + eps_high for positive advantages."""
    dual_clip: float | None = None
    """c > 1 of dual clip for negative advantages; None disables it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_clip_range(self.eps_low, self.eps_high)
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")


@dataclass(frozen=True)
class GRPOConfig(PPOClipConfig):
    """GRPO's defaults for PPO-clip; see rl/losses/grpo.py."""

    aggregation: AggregationMode = AggregationMode.SEQ_MEAN_TOKEN_MEAN
    kl_coef: float = 0.04
    """beta of the paper; the reference logprobs are then required."""
    kl_estimator: KLEstimator = KLEstimator.K3


@dataclass(frozen=True)
class DAPOConfig(PPOClipConfig):
    """DAPO's defaults for PPO-clip (clip-higher, token-mean); see rl/losses/dapo.py."""

    aggregation: AggregationMode = AggregationMode.TOKEN_MEAN
    eps_low: float = 0.2
    eps_high: float = 0.28


@dataclass(frozen=True)
class DrGRPOConfig(PPOClipConfig):
    """Dr.GRPO's defaults for PPO-clip; see rl/losses/dr_grpo.py."""

    aggregation: AggregationMode = AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM


@dataclass(frozen=True)
class GSPOConfig(ObjectiveConfig):
    """GSPO: the clip range bounds a per-sequence ratio; see rl/losses/gspo.py."""

    aggregation: AggregationMode = AggregationMode.SEQ_MEAN_TOKEN_MEAN
    eps_low: float = 3e-4
    eps_high: float = 4e-4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_clip_range(self.eps_low, self.eps_high)


@dataclass(frozen=True)
class CISPOConfig(ObjectiveConfig):
    """CISPO: the clip range bounds a detached IS weight; see rl/losses/cispo.py."""

    aggregation: AggregationMode = AggregationMode.TOKEN_MEAN
    eps_low: float = 1.0
    eps_high: float = 0.28

    def __post_init__(self) -> None:
        super().__post_init__()
        check_clip_range(self.eps_low, self.eps_high)


# The one list of objective names; rl/losses/__init__.py maps each config class to
# the objective it builds.
OBJECTIVE_CONFIGS: dict[str, type[ObjectiveConfig]] = {
    "ppo_clip": PPOClipConfig,
    "grpo": GRPOConfig,
    "dapo": DAPOConfig,
    "gspo": GSPOConfig,
    "cispo": CISPOConfig,
    "dr_grpo": DrGRPOConfig,
}

OBJECTIVE_NAMES: tuple[str, ...] = tuple(OBJECTIVE_CONFIGS)


def objective_config_class(name: str) -> type[ObjectiveConfig]:
    """The config dataclass of objective `name`, for building it from YAML values."""
    try:
        return OBJECTIVE_CONFIGS[name]
    except KeyError:
        raise ValueError(
            f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVE_NAMES)}"
        ) from None
