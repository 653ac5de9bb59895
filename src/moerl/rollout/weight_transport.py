"""Point-to-point messages of a weight version through bounded staging buffers.

A sender packs each of its messages (`parallel.shard_plan.Message`: slabs of its
own tensors) into one of `window` staging buffers and sends it; packing the next
runs while the last is on the wire. A receiver posts its next receives into its own
`window` buffers and copies each arrived message into the tensors it fills while the
next arrives. Both go through their messages in the plan's order, so no rank waits
on one that is not coming, and every wait ends by the version's deadline. A message
a rank sends itself is copied straight across.

`Traffic` counts what actually moved: the staging bytes held at once (a rank's
memory beyond its weights), the bytes and messages on the wire.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from moerl.parallel.shard_messages import Load, Message
from moerl.parallel.shard_plan import Transfer
from moerl.rollout.weight_group import WeightGroup, dtype_of, wait

WINDOW = 2  # staging buffers a rank holds: one packed or unpacked while one moves


@dataclass
class Traffic(Load):
    """What this rank moved in one version, as counted by the transport (the plan's
    `Load`, measured), and the most staging-buffer bytes it held at once."""

    staging_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class _Staging:
    """Up to WINDOW buffers, each as large as the biggest message that needs it."""

    def __init__(self, plan: Sequence[Message], device: torch.device, traffic: Traffic) -> None:
        self.size = max((m.nbytes for m in plan), default=0)
        self.device, self.traffic = device, traffic
        self.free: list[torch.Tensor] = []
        self.made = 0

    def take(self) -> torch.Tensor:
        if self.free:
            return self.free.pop()
        assert self.made < WINDOW, "more buffers than the window"
        self.made += 1
        self.traffic.staging_bytes = max(self.traffic.staging_bytes, self.made * self.size)
        return torch.empty(self.size, dtype=torch.uint8, device=self.device)


def _slab(buffer: torch.Tensor, offset: int, part: Transfer) -> torch.Tensor:
    raw = buffer[offset : offset + part.nbytes]
    return raw.view(dtype_of(part.dtype)).view(part.shape)


def _source(tensors: Mapping[str, torch.Tensor], part: Transfer) -> torch.Tensor:
    return tensors[part.name].narrow(part.dim, part.src_offset, part.length)


def _target(fill: Callable[[str], torch.Tensor], part: Transfer) -> torch.Tensor:
    return fill(part.name).narrow(part.dim, part.dst_offset, part.length)


def send_messages(group: WeightGroup, rank: int, plan: Sequence[Message],
                  tensors: Mapping[str, torch.Tensor], device: torch.device, deadline: float,
                  traffic: Traffic) -> None:
    """Send this rank's messages of `plan` (in its order) from `tensors` (by name)."""
    outgoing = [m for m in plan if m.src == rank and m.dst != rank]
    staging = _Staging(outgoing, device, traffic)
    in_flight: deque[tuple[object, torch.Tensor]] = deque()
    for message in outgoing:
        if len(in_flight) == WINDOW:
            work, buffer = in_flight.popleft()
            wait(work, deadline)
            staging.free.append(buffer)
        buffer = staging.take()
        with torch.no_grad():
            for part, offset in zip(message.parts, message.offsets, strict=True):
                _slab(buffer, offset, part).copy_(_source(tensors, part))
        in_flight.append((group.send([buffer[: message.nbytes]], message.dst, message.index),
                          buffer))
        traffic.bytes_sent += message.nbytes
        traffic.messages_sent += 1
    for work, _ in in_flight:
        wait(work, deadline)


def receive_messages(group: WeightGroup, rank: int, plan: Sequence[Message],
                     fill: Callable[[str], torch.Tensor], device: torch.device,
                     deadline: float, traffic: Traffic,
                     own: Mapping[str, torch.Tensor] | None = None,
                     done: Callable[[Message], None] | None = None) -> None:
    """Receive this rank's messages of `plan` (in its order) into the tensors `fill`
    gives by name; a message from this rank itself is copied from `own`. `done` is
    called after each message has landed."""
    incoming = [m for m in plan if m.dst == rank]
    remote = deque(m for m in incoming if m.src != rank)
    staging = _Staging(list(remote), device, traffic)
    posted: deque[tuple[Message, object, torch.Tensor]] = deque()

    def post() -> None:
        while remote and len(posted) < WINDOW:
            message, buffer = remote.popleft(), staging.take()
            posted.append((message, group.recv([buffer[: message.nbytes]], message.src,
                                               message.index), buffer))

    for message in incoming:
        with torch.no_grad():
            if message.src == rank:
                assert own is not None, "a message to itself needs this rank's own tensors"
                for part in message.parts:
                    _target(fill, part).copy_(_source(own, part))
            else:
                post()
                arrived, work, buffer = posted.popleft()
                assert arrived is message, "receives posted out of the plan's order"
                wait(work, deadline)  # the next message is arriving meanwhile
                for part, offset in zip(message.parts, message.offsets, strict=True):
                    _target(fill, part).copy_(_slab(buffer, offset, part))
                staging.free.append(buffer)
                traffic.bytes_received += message.nbytes
                traffic.messages_received += 1
        if done is not None:
            done(message)
