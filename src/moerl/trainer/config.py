"""Typed configs of training (the `optim` and `sft` groups).

Imports nothing heavy (no torch, no Megatron): the launcher reads them to check a
run at start-up; `optimizer.py` and `sft.py` act on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moerl.parallel.layout import ParallelLayout


@dataclass
class OptimConfig:
    """Adam with decoupled weight decay, linear warmup then cosine decay to min_lr."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay_steps: int = 1000  # the cosine reaches min_lr after this many steps
    # None: as the layout says (ParallelLayout.use_distributed_optimizer).
    use_distributed_optimizer: bool | None = None

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim: need 0 <= min_lr <= lr and lr > 0, got {self}")
        if self.warmup_steps < 0 or self.decay_steps <= self.warmup_steps:
            raise ValueError("optim.decay_steps: must exceed warmup_steps (>= 0)")



@dataclass
class SFTConfig:
    """The `sft` group: supervised fine-tuning (`moerl sft`, or the warm-up before RL)
    on instruction data, loss on the responses only."""

    steps: int = 0  # 0: no SFT
    global_batch: int = 32  # rows per step (with `pack`, each row holds several examples)
    micro_batch: int = 8
    seq_length: int = 96
    lr: float = 3e-3
    warmup_steps: int = 10
    pack: bool = False  # several examples per row, attention kept inside each
    # JSONL of {"prompt": ..., "response": ...}; null: the `data` group's reference
    # completions (the prompts' `reference` field)
    data_path: str | None = None

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft.{name}: must be >= 1")
        if self.steps < 0 or self.warmup_steps < 0:
            raise ValueError("sft.steps and sft.warmup_steps: must be >= 0")
        if self.global_batch % self.micro_batch:
            raise ValueError(f"sft.global_batch: {self.global_batch} is not a multiple of "
                             f"sft.micro_batch ({self.micro_batch})")

    def check_layout(self, layout: ParallelLayout, mtp_layers: int) -> None:
        """The batch-shape rules of a layout, naming the sft field to change."""
        if self.global_batch % (self.micro_batch * layout.dp):
            raise ValueError(
                f"sft.global_batch: {self.global_batch} must be a multiple of sft.micro_batch "
                f"* dp = {self.micro_batch * layout.dp}"
            )
        split = layout.sequence_multiple()
        if self.seq_length % split:
            raise ValueError(
                f"sft.seq_length: {self.seq_length} must be a multiple of {split} "
                "(2*cp for the context-parallel split, times tp under sequence parallelism)"
            )
        if self.pack and layout.cp > 1 and mtp_layers:
            raise ValueError(
                "sft.pack: multi-token prediction over packed rows under context parallelism "
                "is not supported; set sft.pack=false, model.mtp_num_layers=0 or parallel.cp=1"
            )
