"""Which rank sends which bytes of a weight version to which rank.

A layout cuts each weight along at most one dimension (tensor parallelism), and a
rank holds a `Piece` of it: index ranges along that dimension, in the order its
local tensor stores them. A gated fc1 ([gate; up], 2f rows) cut over t ranks is two
ranges on rank r, [r f/t, (r+1) f/t) then [f + r f/t, f + (r+1) f/t). Two layouts
of one model (the trainer's, a rollout server's) hold different pieces of the same
tensors; what a sender passes a receiver is the overlap of their pieces along the
cut dimension (`overlap`, `Transfer`s).

Every byte has one sender. Of the ranks holding the same piece (data-parallel
replicas, and the tensor-parallel ranks of a tensor they all hold whole) `owned_by`
gives each piece to one, the largest pieces first to the least loaded, so each
replica sends about its share; `first_senders` drops a piece two senders still both
own (a tied embedding on the first and last pipeline stage).

A pair's transfers, in one order both ends compute, are cut into messages of at most
`buffer_bytes` (`messages`), and every rank works through its own messages in one
order of the whole version (`schedule`: the k-th message of every pair before any
pair's (k+1)-th). With a bounded window of messages in flight on every rank this
cannot deadlock: the first unfinished message of the schedule has every earlier
message of its sender and of its receiver finished, so both are waiting on it.

Pure arithmetic on names and shapes (no tensors): the stream computes its plan from
the pieces the ranks exchange when the group forms, and the weight sync benchmark
computes the same plan for a layout it never builds.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
            "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
ALIGN = 16  # bytes: where each transfer starts inside a message, so any dtype views it


class PlanError(ValueError):
    """Two layouts that cannot be matched, or a buffer too small; the message says which."""


def itemsize(dtype: str) -> int:
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise PlanError(f"weight dtype {dtype!r} is not one of {sorted(ITEMSIZE)}") from None


@dataclass(frozen=True)
class Piece:
    """The part of tensor `name` (whole shape `shape`) one rank holds."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    dim: int  # the dimension the layout cuts (0 for a tensor held whole)
    ranges: tuple[tuple[int, int], ...]  # [start, stop) along dim, in local order

    @staticmethod
    def whole(name: str, dtype: str, shape: tuple[int, ...]) -> Piece:
        if not shape:
            raise PlanError(f"{name}: a 0-d tensor has no dimension to send along")
        return Piece(name, dtype, tuple(shape), 0, ((0, shape[0]),))

    @property
    def cut(self) -> bool:
        return self.ranges != ((0, self.shape[self.dim]),)

    @property
    def extent(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (*self.shape[:self.dim], self.extent, *self.shape[self.dim + 1:])

    @property
    def unit_bytes(self) -> int:
        """Bytes of one index along `dim`."""
        return math.prod(self.shape) // self.shape[self.dim] * itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.extent * self.unit_bytes

    def along(self, dim: int) -> Piece:
        """This (whole) piece described along another dimension."""
        if dim == self.dim:
            return self
        assert not self.cut, f"{self.name}: a cut piece has one dimension"
        return replace(self, dim=dim, ranges=((0, self.shape[dim]),))

    def local_offset(self, index: int) -> int:
        """Where whole-tensor `index` along `dim` sits in this rank's tensor."""
        before = 0
        for start, stop in self.ranges:
            if start <= index < stop:
                return before + index - start
            before += stop - start
        raise ValueError(f"{self.name}: index {index} is not in {self.ranges}")

    def encode(self) -> list[object]:
        """JSON form, for the exchange when a group forms."""
        return [self.name, self.dtype, list(self.shape), self.dim, [list(r) for r in self.ranges]]

    @staticmethod
    def decode(item: Sequence[Any]) -> Piece:
        name, dtype, shape, dim, ranges = item
        return Piece(str(name), str(dtype), tuple(int(n) for n in shape), int(dim),
                     tuple((int(a), int(b)) for a, b in ranges))


@dataclass(frozen=True)
class Transfer:
    """A slab of tensor `name` moved from a sender's piece into a receiver's: `shape`
    is the whole tensor's with `length` along `dim`; offsets are along `dim` in each
    side's local tensor. `dtype` is the sender's (the receiver casts on arrival)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    dim: int
    src_offset: int
    dst_offset: int

    @property
    def length(self) -> int:
        return self.shape[self.dim]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def split(self, max_length: int) -> list[Transfer]:
        """Slabs of at most `max_length` indices along `dim`."""
        out = []
        for start in range(0, self.length, max_length):
            length = min(max_length, self.length - start)
            shape = (*self.shape[:self.dim], length, *self.shape[self.dim + 1:])
            out.append(replace(self, shape=shape, src_offset=self.src_offset + start,
                               dst_offset=self.dst_offset + start))
        return out


def overlap(src: Piece, dst: Piece) -> list[Transfer]:
    """What the holder of `src` sends the holder of `dst` (the same tensor)."""
    if src.shape != dst.shape:
        raise PlanError(f"{dst.name}: the sender holds it as {src.shape}, the receiver as "
                        f"{dst.shape}; both sides must build the same model")
    if src.cut and dst.cut and src.dim != dst.dim:
        raise PlanError(f"{dst.name}: cut along dim {src.dim} by the sender, {dst.dim} by the "
                        "receiver")
    dim = src.dim if src.cut else dst.dim
    a, b = src.along(dim), dst.along(dim)
    out = []
    for s_start, s_stop in a.ranges:
        for d_start, d_stop in b.ranges:
            lo, hi = max(s_start, d_start), min(s_stop, d_stop)
            if lo < hi:
                shape = (*src.shape[:dim], hi - lo, *src.shape[dim + 1:])
                out.append(Transfer(src.name, src.dtype, shape, dim, a.local_offset(lo),
                                    b.local_offset(lo)))
    return out


def owned_by(pieces: Sequence[Piece], replicas: int) -> list[int]:
    """The replica (0 .. replicas-1) that sends each of `pieces`, which every replica
    holds alike: largest first, each to the replica with the fewest bytes so far."""
    heap = [(0, r) for r in range(replicas)]
    owner = [0] * len(pieces)
    for i in sorted(range(len(pieces)), key=lambda i: (-pieces[i].nbytes, i)):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + pieces[i].nbytes, r))
    return owner


def first_senders(senders: Mapping[int, Sequence[Piece]]) -> dict[int, list[Piece]]:
    """Each distinct piece from the lowest rank that offers it."""
    seen: set[tuple[str, int, tuple[tuple[int, int], ...]]] = set()
    out: dict[int, list[Piece]] = {}
    for rank in sorted(senders):
        mine = out.setdefault(rank, [])
        for piece in senders[rank]:
            key = (piece.name, piece.dim, piece.ranges)
            if key not in seen:
                seen.add(key)
                mine.append(piece)
    return out


def _by_name(parties: Mapping[int, Sequence[Piece]]) -> dict[str, list[tuple[int, Piece]]]:
    index: dict[str, list[tuple[int, Piece]]] = defaultdict(list)
    for rank in sorted(parties):
        for piece in parties[rank]:
            index[piece.name].append((rank, piece))
    return index


def routes_from(mine: Sequence[Piece], receivers: Mapping[int, Sequence[Piece]]
                ) -> dict[int, list[Transfer]]:
    """A sender's transfers to each receiver, in the pair's order."""
    held = {p.name: p for p in mine}
    out: dict[int, list[Transfer]] = {}
    for rank in sorted(receivers):
        transfers = [t for piece in receivers[rank] if piece.name in held
                     for t in overlap(held[piece.name], piece)]
        if transfers:
            out[rank] = sorted(transfers, key=_pair_order)
    return out


def routes_to(mine: Sequence[Piece], senders: Mapping[int, Sequence[Piece]]
              ) -> dict[int, list[Transfer]]:
    """A receiver's transfers from each sender, in the pair's order; every index of
    every piece it holds must come from some sender."""
    index = _by_name(senders)
    out: dict[int, list[Transfer]] = defaultdict(list)
    for piece in mine:
        covered = 0  # elements
        for rank, offered in index.get(piece.name, []):
            found = overlap(offered, piece)
            covered += sum(math.prod(t.shape) for t in found)
            out[rank] += found
        if covered != math.prod(piece.local_shape):
            raise PlanError(f"{piece.name}: the senders cover {covered} of the "
                            f"{math.prod(piece.local_shape)} elements this rank holds; the "
                            "trainer and the server must build the same model")
    return {rank: sorted(ts, key=_pair_order) for rank, ts in sorted(out.items()) if ts}


def _pair_order(t: Transfer) -> tuple[str, int]:
    return t.name, t.dst_offset


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def messages(transfers: Iterable[Transfer], buffer_bytes: int) -> list[list[Transfer]]:
    """`transfers` packed in order into messages of at most `buffer_bytes` (each
    transfer at an aligned offset), a transfer larger than that cut along its dim."""
    out: list[list[Transfer]] = [[]]
    used = 0
    for transfer in transfers:
        unit = transfer.nbytes // transfer.length
        if aligned(unit) > buffer_bytes:
            raise PlanError(f"rl.weight_sync_staging_bytes: {transfer.name} moves {unit} bytes "
                            f"per index of dim {transfer.dim}, more than one staging buffer "
                            f"({buffer_bytes} bytes, half the setting); raise it")
        for part in transfer.split(max(buffer_bytes // unit, 1)):
            size = aligned(part.nbytes)
            if size > buffer_bytes - used and out[-1]:
                out.append([])
                used = 0
            out[-1].append(part)
            used += size
    return out if out[-1] else out[:-1]


@dataclass(frozen=True)
class Message:
    """The `index`-th message from `src` to `dst` (group ranks)."""

    src: int
    dst: int
    index: int
    parts: tuple[Transfer, ...]

    @property
    def offsets(self) -> list[int]:
        """Where each part starts in the message's bytes."""
        return [0, *itertools.accumulate(aligned(p.nbytes) for p in self.parts[:-1])]

    @property
    def nbytes(self) -> int:
        """On the wire: every part at an aligned offset."""
        return self.offsets[-1] + self.parts[-1].nbytes

    @property
    def payload(self) -> int:
        return sum(p.nbytes for p in self.parts)


def schedule(pairs: Mapping[tuple[int, int], Sequence[Transfer]], buffer_bytes: int
             ) -> list[Message]:
    """Every message of the (src, dst) `pairs`, in the order of the whole version."""
    out = [Message(src, dst, k, tuple(parts))
           for (src, dst), transfers in pairs.items()
           for k, parts in enumerate(messages(transfers, buffer_bytes))]
    return sorted(out, key=lambda m: (m.index, m.src, m.dst))


@dataclass
class Load:
    """What one rank moves in a version: wire bytes and messages, out and in."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0


def loads(plan: Iterable[Message]) -> dict[int, Load]:
    """Each rank's load under `plan` (a message to itself moves nothing)."""
    out: dict[int, Load] = defaultdict(Load)
    for message in plan:
        if message.src == message.dst:
            continue
        out[message.src].bytes_sent += message.nbytes
        out[message.src].messages_sent += 1
        out[message.dst].bytes_received += message.nbytes
        out[message.dst].messages_received += 1
    return dict(out)
