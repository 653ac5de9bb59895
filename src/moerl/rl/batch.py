"""What one collect step hands the update: the training samples and the step's metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from moerl.data.rl_batch import RLSample


@dataclass
class Batch:
    samples: list[RLSample]
    metrics: dict[str, float] = field(default_factory=dict)
