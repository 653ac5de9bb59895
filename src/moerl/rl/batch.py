"""What one collect step hands the update: the training samples and the step's metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from moerl.data.rl_batch import RLSample
from moerl.rollout.client import RolloutClient


@dataclass
class Batch:
    samples: list[RLSample]
    metrics: dict[str, float] = field(default_factory=dict)


class HasEngines(Protocol):
    """What a collector needs from the controller: the rollout servers' client."""

    @property
    def engines(self) -> RolloutClient: ...
