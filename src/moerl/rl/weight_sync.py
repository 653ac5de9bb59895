"""Trainer -> rollout servers: publish new weights, tell every server to load them.

The filesystem path (the one every cluster has): all trainer ranks write the
weights together to `<root>/v<version>` (atomic; see models.weights), then the
controller asks each rollout server to load that directory. An NCCL broadcast
path for GPU clusters fits the same `WeightSync` protocol: `push` would stream
the tensors to engines that joined a process group instead of writing files.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from moerl.rl.rollout.client import RolloutClient


class Publisher(Protocol):
    def publish(self, directory: str | Path) -> Path: ...


class WeightSync(Protocol):
    def push(self, policy: Publisher, version: int) -> None: ...


class FilesystemWeightSync:
    """`engines` is given on the controller rank only; every rank calls `push`."""

    def __init__(self, root: Path, engines: RolloutClient | None, keep: int = 2) -> None:
        self.root, self.engines, self.keep = root, engines, max(keep, 1)
        self.published: list[Path] = []

    def push(self, policy: Publisher, version: int) -> None:
        path = policy.publish(self.root / f"v{version:06d}")
        if dist.is_initialized():
            dist.barrier()
        if self.engines is None:
            return
        self.engines.update_weights(path, version)
        self.published.append(path)
        # Servers hold their weights in memory once loaded: older directories can go.
        while len(self.published) > self.keep:
            shutil.rmtree(self.published.pop(0), ignore_errors=True)
