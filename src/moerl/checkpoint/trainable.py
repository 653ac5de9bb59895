"""What a checkpoint saves and restores, as a protocol.

The checkpoint package sits below the trainer: it needs a model's chunks, their
optimizer and the learning-rate schedule, not the code that built them.
`moerl.trainer.optimizer.Trainable` is the implementation every run uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class Trainable(Protocol):
    @property
    def model(self) -> Sequence[torch.nn.Module]:
        """The model chunks (DDP-wrapped), one per virtual pipeline stage."""
        ...

    @property
    def optimizer(self) -> MegatronOptimizer: ...

    @property
    def scheduler(self) -> OptimizerParamScheduler: ...
