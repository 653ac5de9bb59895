"""A version's messages: each pair's transfers cut to the staging buffers, and the
order every rank goes through its own.

A pair's transfers (`parallel.shard_plan`), in the order both ends compute, are packed
into messages of at most `buffer_bytes` (`messages`; each transfer at an aligned
offset, a larger one cut along its dimension), and every rank works through its own
messages in one order of the whole version (`schedule`: the k-th message of every
pair before any pair's (k+1)-th). With a bounded window of messages in flight on every
rank this cannot deadlock: the first unfinished message of the schedule has every
earlier message of its sender and of its receiver finished, so both are waiting on it.
`loads` counts what a plan puts on each rank.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from moerl.parallel.shard_plan import PlanError, Transfer

ALIGN = 16  # bytes: where each transfer starts inside a message, so any dtype views it


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
