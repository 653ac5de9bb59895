"""Weights from the trainer to the rollout ranks over a process group of their own.

A weight group is made on a TCP store one trainer rank hosts, apart from either
side's own torch.distributed world (a `ProcessGroupGloo` on CPU, a
`ProcessGroupNCCL` on GPUs), with every wait bounded by the group's timeout. Two
calls form and use it, named as SGLang names them:

- join (`POST /init_weights_update_group`): a `GroupSpec`; a server's rank r takes
  group rank `rank_offset + r`.
- update (`POST /update_weights_from_distributed`): for moerl servers a `Manifest`
  (the version, the group, the message size), the plan having been agreed when the
  group formed (`exchange`, `parallel.shard_plan`): every trainer rank is in the group
  and sends its own pieces point to point (`rollout.weight_transport`). For SGLang
  and vLLM, whose protocols take whole Hugging Face tensors broadcast from group rank
  0, the announced tensors one broadcast each (`broadcast`, `receive_each`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moerl.parallel.shard_plan import Piece, first_senders

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


@dataclass(frozen=True)
class Manifest:
    """One version a moerl server takes from group `group_name`, in messages of at
    most `buffer_bytes` (half the trainer's staging bytes)."""

    version: int
    group_name: str
    buffer_bytes: int = 128 << 20


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
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
    if spec.backend != "gloo":
        raise ValueError(f"weight group backend {spec.backend!r}: use gloo or nccl")
    return dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)


def group_device(backend: str) -> torch.device:
    """Where the group's buffers live: NCCL moves GPU memory, gloo host memory."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wait(work: Any, deadline: float) -> None:
    """Wait for `work` until `deadline` (time.monotonic()); raise TimeoutError after."""
    left = deadline - time.monotonic()
    late = TimeoutError("weight group: an operation did not finish before the deadline")
    if left <= 0:
        raise late
    try:
        finished = work.wait(timedelta(seconds=left))
    except RuntimeError as exc:  # gloo reports its own timeout this way too
        if time.monotonic() >= deadline - 0.05:
            raise late from exc
        raise
    if finished is False:
        raise late


def abort(group: WeightGroup | None) -> None:
    """End a group's pending operations after a failure. Its connections close, and
    its peers' waits fail at once instead of running out their timeout, when the
    caller drops its last reference to the group."""
    if group is not None:
        with contextlib.suppress(RuntimeError):
            group.abort()


def exchange(group: WeightGroup, payload: Any, device: torch.device, deadline: float
             ) -> list[Any]:
    """Every member's JSON `payload`, by group rank (metadata only: names, shapes,
    ranges; sized by the largest member's, once per group)."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(group.size())]
    wait(group.allgather([sizes], [size]), deadline)
    lengths = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    everyone = [torch.empty_like(mine) for _ in lengths]
    wait(group.allgather([everyone], [mine]), deadline)
    return [json.loads(bytes(t[:n].cpu().numpy())) for t, n in zip(everyone, lengths, strict=True)]


def join_with_plan[Plan](spec: GroupSpec, rank: int, sends: Sequence[Piece],
                         holds: Sequence[Piece],
                         plan: Callable[[dict[int, list[Piece]], dict[int, list[Piece]]], Plan]
                         ) -> tuple[WeightGroup, Plan]:
    """Join the group as `rank`, offering the pieces this rank `sends` and `holds`, and
    make this rank's `plan` from every member's (senders by group rank, each piece
    from the first that offers it; receivers by group rank). A failure leaves the
    group."""
    group = open_group(spec, rank)
    try:
        offer = {"sends": [p.encode() for p in sends], "holds": [p.encode() for p in holds]}
        everyone = exchange(group, offer, group_device(spec.backend),
                            time.monotonic() + spec.timeout_s)
        senders = first_senders({r: [Piece.decode(x) for x in e["sends"]]
                                 for r, e in enumerate(everyone) if e["sends"]})
        receivers = {r: [Piece.decode(x) for x in e["holds"]]
                     for r, e in enumerate(everyone) if e["holds"]}
        return group, plan(senders, receivers)
    except BaseException:
        abort(group)
        raise


def broadcast(group: WeightGroup, tensor: torch.Tensor, deadline: float | None = None) -> None:
    """Group rank 0's `tensor` into every member's (bounded by `deadline`, else by the
    group's own timeout)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    work = group.broadcast([tensor], options)
    if deadline is None:
        work.wait()
    else:
        wait(work, deadline)


def receive_each(group: WeightGroup, names: Sequence[str], dtypes: Sequence[str],
                 shapes: Sequence[Sequence[int]], device: torch.device
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver of one broadcast per announced tensor (SGLang's protocol), by name."""
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(tuple(shape), dtype=dtype_of(dtype), device=device)
        broadcast(group, tensor)
        yield name, tensor
