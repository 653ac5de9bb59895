"""Weights from the trainer to the rollout ranks over a process group of their own.

The group is the trainer's global rank 0 (group rank 0, the sender) and every rank of
every rollout server (group ranks 1..), made on a TCP store the trainer hosts, apart
from either side's own torch.distributed world (a `ProcessGroupGloo` on CPU, a
`ProcessGroupNCCL` on GPUs). Two calls, named as SGLang names them:

- join (`POST /init_weights_update_group`): a `GroupSpec`; a server's rank r takes
  group rank `rank_offset + r`.
- update (`POST /update_weights_from_distributed`): a `Manifest` (every tensor's name,
  dtype and shape, the bucket size, the version); the sender then broadcasts the
  tensors in that order, packed into byte buckets of at most `bucket_bytes` (a larger
  tensor goes alone), and every server rank unpacks them. Names are the Megatron
  model's global ones (`models.hf.gather_megatron`); each rank keeps the slices its
  own layout holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
    torch.uint8, torch.int8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}  # fmt: skip


@dataclass(frozen=True)
class GroupSpec:
    """How one party joins the weight group."""

    master_address: str
    master_port: int
    rank_offset: int  # a server's rank r is group rank rank_offset + r
    world_size: int
    group_name: str = "moerl-weights"
    backend: str = "gloo"  # gloo | nccl
    timeout_s: float = 600.0


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_of(self.dtype).itemsize


@dataclass(frozen=True)
class Manifest:
    """One weight version as the sender will broadcast it."""

    tensors: tuple[TensorSpec, ...]
    version: int
    bucket_bytes: int = 64 << 20


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"weight dtype {name!r} is not one of {sorted(_DTYPES)}") from None


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


# A c10d backend of its own (ProcessGroupGloo / ProcessGroupNCCL) outside the default
# world; torch's stubs declare no collectives on these classes.
WeightGroup = Any


def open_group(spec: GroupSpec, rank: int) -> WeightGroup:
    """Join the group as `rank` (0 hosts the store); returns once every member has joined."""
    timeout = timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(spec.master_address, spec.master_port, spec.world_size,
                          is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(spec.group_name, store)
    if spec.backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, spec.world_size,
                                     dist.ProcessGroupNCCL.Options())
    if spec.backend != "gloo":
        raise ValueError(f"weight group backend {spec.backend!r}: use gloo or nccl")
    return dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)


def buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> Iterator[list[int]]:
    """Indices of consecutive tensors whose bytes fit `bucket_bytes` together."""
    current: list[int] = []
    size = 0
    for i, spec in enumerate(specs):
        if current and size + spec.nbytes > bucket_bytes:
            yield current
            current, size = [], 0
        current.append(i)
        size += spec.nbytes
    if current:
        yield current


def _broadcast(group: WeightGroup, buffer: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


def send(group: WeightGroup, manifest: Manifest, tensors: Sequence[torch.Tensor]) -> None:
    """Sender (group rank 0): broadcast `tensors` as `manifest` lists them."""
    staging: torch.Tensor | None = None  # one buffer for every bucket of several tensors
    for index in buckets(manifest.tensors, manifest.bucket_bytes):
        parts = [tensors[i].detach().contiguous().reshape(-1).view(torch.uint8) for i in index]
        if len(parts) == 1:  # the root's buffer is only read: the tensor's own bytes
            _broadcast(group, parts[0])
            continue
        size = sum(p.numel() for p in parts)
        if staging is None or staging.numel() < size:
            staging = torch.empty(max(size, manifest.bucket_bytes), dtype=torch.uint8,
                                  device=parts[0].device)
        torch.cat(parts, out=staging[:size])
        _broadcast(group, staging[:size])


def broadcast_each(group: WeightGroup, tensors: Sequence[torch.Tensor]) -> None:
    """Sender, SGLang's way: one broadcast per tensor, in order, in its own dtype."""
    for tensor in tensors:
        _broadcast(group, tensor.detach().contiguous())


def receive_each(group: WeightGroup, names: Sequence[str], dtypes: Sequence[str],
                 shapes: Sequence[Sequence[int]], device: torch.device
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver of `broadcast_each`: each announced tensor as it arrives, by name."""
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(tuple(shape), dtype=dtype_of(dtype), device=device)
        _broadcast(group, tensor)
        yield name, tensor


def broadcast_into(group: WeightGroup, buffer: torch.Tensor) -> None:
    """Receiver: the next bucket's bytes into `buffer` (its size)."""
    _broadcast(group, buffer)


def views_of(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """The tensors of one received bucket, views of its bytes (a copy where a dtype's
    alignment forbids a view)."""
    out: list[torch.Tensor] = []
    start = 0
    for spec in specs:
        raw = buffer[start : start + spec.nbytes]
        dtype = dtype_of(spec.dtype)
        if start % dtype.itemsize:  # a dtype view needs an aligned start
            raw = raw.clone()
        out.append(raw.view(dtype).reshape(spec.shape))
        start += spec.nbytes
    return out
