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

A pair's transfers, in one order both ends compute (`routes_from`, `routes_to`), are
then cut into messages (`parallel.shard_messages`).

Pure arithmetic on names and shapes (no tensors): the stream computes its plan from
the pieces the ranks exchange when the group forms, and the weight sync benchmark
computes the same plan for a layout it never builds.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
            "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


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
    start: int = 0  # where along dim the rank's tensor holding it has its first index

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
        assert not self.cut and not self.start, f"{self.name}: a cut piece has one dimension"
        return replace(self, dim=dim, ranges=((0, self.shape[dim]),))

    def local_offset(self, index: int) -> int:
        """Where whole-tensor `index` along `dim` sits in this rank's tensor."""
        before = self.start
        for start, stop in self.ranges:
            if start <= index < stop:
                return before + index - start
            before += stop - start
        raise ValueError(f"{self.name}: index {index} is not in {self.ranges}")

    def split(self, parts: int) -> list[Piece]:
        """This piece in `parts` about equal runs of its local indices (as many as it
        has indices, at most), each knowing where it starts in this rank's tensor."""
        out = []
        for i in range(min(parts, self.extent)):
            lo = self.start + i * self.extent // parts
            hi = self.start + (i + 1) * self.extent // parts
            out.append(replace(self, ranges=self._global(lo, hi), start=lo))
        return out

    def _global(self, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """The whole-tensor ranges of local indices [lo, hi)."""
        out, before = [], self.start
        for a, b in self.ranges:
            first, last = max(lo, before), min(hi, before + b - a)
            if first < last:
                out.append((a + first - before, a + last - before))
            before += b - a
        return tuple(out)

    def encode(self) -> list[object]:
        """JSON form, for the exchange when a group forms."""
        return [self.name, self.dtype, list(self.shape), self.dim,
                [list(r) for r in self.ranges], self.start]

    @staticmethod
    def decode(item: Sequence[Any]) -> Piece:
        name, dtype, shape, dim, ranges, start = item
        return Piece(str(name), str(dtype), tuple(int(n) for n in shape), int(dim),
                     tuple((int(a), int(b)) for a, b in ranges), int(start))


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


SPLIT_BYTES = 4 << 20  # a piece larger than this is shared out among its holders


def owned(pieces: Sequence[Piece], replica: Callable[[Piece], tuple[int, int, str]]
          ) -> list[tuple[int, Piece]]:
    """(index into `pieces`, the part of it this rank sends). `replica(piece)`: this
    rank's index among the ranks holding that piece alike, their count, and a name for
    the class of pieces they all hold in the same order (each class is split on its
    own). A piece over SPLIT_BYTES is cut in up to that many equal parts, so a table
    that every server rank needs is not sent by one rank alone."""
    classes: dict[str, list[int]] = defaultdict(list)
    where: dict[str, tuple[int, int]] = {}
    for i, piece in enumerate(pieces):
        index, count, kind = replica(piece)
        classes[kind].append(i)
        where[kind] = (index, count)
    mine: list[tuple[int, Piece]] = []
    for kind, members in classes.items():
        index, count = where[kind]
        shares = _shares(tuple(pieces[i] for i in members), count)
        mine += [(members[at], part) for at, part in shares[index]]
    return sorted(mine, key=lambda p: (p[0], p[1].start))


@functools.lru_cache(maxsize=256)
def _shares(pieces: tuple[Piece, ...], count: int) -> list[list[tuple[int, Piece]]]:
    """Each of `count` replicas' parts of `pieces` (its position in `pieces`, the part);
    the same for every replica, so computed once per class."""
    parts = [(at, part) for at, piece in enumerate(pieces)
             for part in piece.split(min(count, max(1, piece.nbytes // SPLIT_BYTES)))]
    shares: list[list[tuple[int, Piece]]] = [[] for _ in range(count)]
    for part, owner in zip(parts, owned_by([p for _, p in parts], count), strict=True):
        shares[owner].append(part)
    return shares


def first_senders(senders: Mapping[int, Sequence[Piece]]) -> dict[int, list[Piece]]:
    """Each distinct piece from the lowest rank that offers it."""
    seen: set[tuple[str, int, tuple[tuple[int, int], ...]]] = set()  # start: the sender's own
    out: dict[int, list[Piece]] = {}
    for rank in sorted(senders):
        mine = out.setdefault(rank, [])
        for piece in senders[rank]:
            key = (piece.name, piece.dim, piece.ranges)
            if key not in seen:
                seen.add(key)
                mine.append(piece)
    return out


def by_name(senders: Mapping[int, Sequence[Piece]]) -> dict[str, list[tuple[int, Piece]]]:
    """What is offered of each tensor, by whom: the index `routes_to` reads."""
    index: dict[str, list[tuple[int, Piece]]] = defaultdict(list)
    for rank in sorted(senders):
        for piece in senders[rank]:
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


def routes_to(mine: Sequence[Piece], offered: Mapping[str, list[tuple[int, Piece]]]
              ) -> dict[int, list[Transfer]]:
    """A receiver's transfers from each sender (`offered`: `by_name` of the senders),
    in the pair's order; every element of every piece it holds must come from some
    sender."""
    out: dict[int, list[Transfer]] = defaultdict(list)
    for piece in mine:
        covered = 0  # elements
        for rank, source in offered.get(piece.name, []):
            found = overlap(source, piece)
            covered += sum(math.prod(t.shape) for t in found)
            out[rank] += found
        if covered != math.prod(piece.local_shape):
            raise PlanError(f"{piece.name}: the senders cover {covered} of the "
                            f"{math.prod(piece.local_shape)} elements this rank holds; the "
                            "trainer and the server must build the same model")
    return {rank: sorted(ts, key=_pair_order) for rank, ts in sorted(out.items()) if ts}


def _pair_order(t: Transfer) -> tuple[str, int]:
    return t.name, t.dst_offset
