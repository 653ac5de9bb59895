"""Seconds of one checkpoint save, from its bytes and the filesystem's write bandwidth.

    bytes    the policy's weights at their precision (bf16: 2 bytes a parameter; FP8
             primary weights: 1 for the linear layers, 2 for embeddings, norms and
             routers; fp32: 4) + the fp32 master weights (4, none for an fp32 run,
             which optimizes its weights in place) + Adam's two moments (8); the same
             of PPO's critic when the run has one. The reference model is not saved:
             it is read from the run's initial weights.
    seconds  bytes / `cluster.checkpoint_write_gbps`, the aggregate GB/s the shared
             filesystem takes from every node at once (every rank writes its own
             shard, `checkpoint.tensor_files`), so the slowest writer is the
             filesystem, not a rank.

Kimi-K2 (1.03T parameters, FP8 primary weights) saves ~13.4 TB: 4.5 minutes at 50 GB/s.
The cadence follows: `checkpoint.interval_minutes` (`interval_minutes`) is at least
30 minutes and at least two saves, since a save waits for the one in flight; and the
SIGUSR1 lead before a time limit must cover the step that is running plus one save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moerl.models.arch import MoEArch
from moerl.parallel.layout import ParallelLayout
from moerl.planning.memory import RunSettings, critic_split, primary_weight_bytes
from moerl.planning.stages import ParamSplit, stage_params

GB = 1e9
MIN_INTERVAL_MINUTES = 30


def _trainable_bytes(split: ParamSplit, run: RunSettings) -> float:
    master = 0.0 if run.precision == "fp32" else 4.0
    return primary_weight_bytes(split, run.precision) + (master + 8.0) * split.total


def save_bytes(arch: MoEArch, run: RunSettings) -> float:
    """Bytes of one checkpoint's tensors (the model whole: one rank's view at TP1 PP1)."""
    whole = ParallelLayout()
    total = _trainable_bytes(stage_params(arch, whole, 0), run)
    if run.critic:
        total += _trainable_bytes(critic_split(arch, whole, 0), run)
    return total


@dataclass(frozen=True)
class SavePlan:
    """One save: its bytes, the bandwidth it is written at, and the time that takes."""

    bytes: float
    write_gbps: float

    @property
    def seconds(self) -> float:
        return self.bytes / (self.write_gbps * GB)

    def describe(self) -> str:
        return (f"{self.bytes / 1e12:.2f} TB (weights, fp32 master, Adam moments), "
                f"{self.seconds:.0f} s at {self.write_gbps:g} GB/s "
                "(cluster.checkpoint_write_gbps)")


def save_plan(arch: MoEArch, run: RunSettings, write_gbps: float) -> SavePlan:
    if write_gbps <= 0:
        raise ValueError(f"cluster.checkpoint_write_gbps={write_gbps}: must be > 0")
    return SavePlan(save_bytes(arch, run), write_gbps)


def interval_minutes(save: SavePlan) -> int:
    """The planned `checkpoint.interval_minutes`: 30, or two saves rounded up to 5."""
    return max(MIN_INTERVAL_MINUTES, 5 * math.ceil(2 * save.seconds / 60 / 5))
