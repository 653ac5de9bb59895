"""A streamed weight version into one rank of a moerl rollout server, keeping only
what this rank holds.

The version arrives bucket by bucket (`weight_group.send`'s broadcasts). Of each
bucket this rank keeps its slices of the tensors its layout holds
(`models.hf.local_tensors`, `shard`) and nothing else, so it never holds more than its
own shard of the version and one bucket: at Kimi-K2's scale a rank holds a
thirty-second of the model, and a whole version would not fit beside it. A bucket
whose every tensor this rank holds whole (no tensor-parallel cut) is kept as received
and the new weights are views of it; of any other bucket the rank's slices are copied
out and its buffer takes the next such bucket. `stage` only receives; the engine
swaps the staged version in (`install`) once every tensor has arrived on every rank,
so a failure leaves the old version whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moerl.models.arch import MoEArch
from moerl.rollout.weight_group import (
    Manifest,
    TensorSpec,
    WeightGroup,
    broadcast_into,
    buckets,
    views_of,
)


@dataclass
class BufferPool:
    """Receive buffers kept across versions (a fresh buffer's first touch halves the
    receive rate): those the live weights are views of, the previous version's (free
    for kept buckets of the same size), and one scratch buffer for copied buckets."""

    live: list[torch.Tensor] = field(default_factory=list)
    spare: list[torch.Tensor] = field(default_factory=list)
    scratch: torch.Tensor | None = None

    def take(self, size: int, device: torch.device) -> torch.Tensor:
        found = next((b for b in self.spare if b.numel() == size and b.device == device), None)
        if found is None:
            return torch.empty(size, dtype=torch.uint8, device=device)
        self.spare.remove(found)
        return found

    def scratch_of(self, size: int, device: torch.device) -> torch.Tensor:
        if self.scratch is None or self.scratch.numel() < size or self.scratch.device != device:
            self.scratch = torch.empty(size, dtype=torch.uint8, device=device)
        return self.scratch[:size]


@dataclass
class Staged:
    """A received version on this rank: (parameter, its new value) for every weight it
    holds, the buffers those values are views of, or why it cannot be installed."""

    values: list[tuple[torch.Tensor, torch.Tensor]]
    kept: list[torch.Tensor]
    problem: str | None


def stage(group: WeightGroup, manifest: Manifest, model: torch.nn.Module, arch: MoEArch,
          pool: BufferPool, device: torch.device) -> Staged:
    """Receive every bucket of `manifest` (all of them, whatever this rank keeps: the
    broadcasts are collective) and keep this rank's slices."""
    from moerl.models.hf import held_whole, local_tensors, shard

    local = dict(local_tensors(model, arch))
    new: dict[str, torch.Tensor] = {}
    kept: list[torch.Tensor] = []
    problem: str | None = None
    for index in buckets(manifest.tensors, manifest.bucket_bytes):
        specs = [manifest.tensors[i] for i in index]
        size = sum(s.nbytes for s in specs)
        whole = all(s.name in local and held_whole(s.name, local[s.name]) for s in specs)
        buffer = pool.take(size, device) if whole else pool.scratch_of(size, device)
        broadcast_into(group, buffer)
        for spec, view in zip(specs, views_of(buffer, specs), strict=True):
            mine = local.get(spec.name)
            if mine is None:
                continue
            part = shard(spec.name, view, mine)
            if part.shape != mine.shape:
                problem = problem or _arrived_as(manifest, spec, tuple(mine.shape))
                continue
            new[spec.name] = part if whole else part.clone(memory_format=torch.contiguous_format)
        if whole:
            kept.append(buffer)
    missing = next((name for name in local if name not in new), None)
    if problem is None and missing is not None:
        problem = f"version {manifest.version}: {missing} was not sent"
    return Staged([(local[n], new[n]) for n in local if n in new], kept, problem)


def _arrived_as(manifest: Manifest, spec: TensorSpec, held: tuple[int, ...]) -> str:
    return (f"version {manifest.version}: {spec.name} arrived as {spec.shape}, this rank "
            f"holds {held}")


def install(staged: Staged, pool: BufferPool) -> None:
    """Swap the staged values in. On CPU the received bytes become the weights; a GPU
    keeps its weights' addresses (the dynamic engine's CUDA graphs read them)."""
    swapped = False
    with torch.no_grad():
        for param, value in staged.values:
            if value.device.type == "cpu" == param.device.type and value.dtype == param.dtype:
                param.data = value.contiguous()
                swapped = True
            else:
                param.copy_(value)
    if swapped:  # the weights are views of the kept buffers; the last version's are free
        pool.spare, pool.live = pool.live, staged.kept
    else:
        pool.spare = staged.kept
