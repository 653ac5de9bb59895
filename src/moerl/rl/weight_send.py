"""The trainer's side of a moerl weight group: every trainer rank sends its own share.

Every trainer rank is a member of the group (ranks 0 .. T-1, the servers' ranks
after). When it forms (`join`), each trainer rank offers the pieces it owns
(`models.pieces.owned_pieces`: its balanced share among the ranks holding the same
slices) and learns the pieces every server rank holds (`weight_group.exchange`);
from both it computes once which slabs of its own tensors go to which server rank
(`parallel.shard_plan.routes_from`). A version (`send_version`) is then read straight
from the rank's parameters into two staging buffers and sent point to point, every
server of every engine fed at once: no rank gathers anything, and none holds more
than its own weights and the staging buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.models.arch import MoEArch
from moerl.models.pieces import held_pieces, owned_pieces
from moerl.parallel.shard_messages import schedule
from moerl.parallel.shard_plan import Transfer, routes_from
from moerl.rollout.weight_group import GroupSpec, WeightGroup, group_device, join_with_plan
from moerl.rollout.weight_transport import Traffic, send_messages


@dataclass
class SendLink:
    """This trainer rank's place in a weight group and what it sends each server rank."""

    group: WeightGroup
    spec: GroupSpec
    rank: int  # in the group: the trainer's global rank
    routes: dict[int, list[Transfer]]  # server rank in the group -> transfers, in order
    owned_bytes: int  # of the pieces this rank sends
    shard_bytes: int  # of every piece this rank holds


def join(spec: GroupSpec, rank: int, chunks: list[torch.nn.Module], arch: MoEArch
         ) -> SendLink:
    """Join the group as `rank` and agree the plan with every member."""
    held = held_pieces(chunks, arch)
    offered = [p for p, _ in owned_pieces(held)]
    group, (mine, routes) = join_with_plan(
        spec, rank, offered, [],
        lambda senders, receivers: (senders.get(rank, []),
                                    routes_from(senders.get(rank, []), receivers)))
    return SendLink(group, spec, rank, routes, sum(p.nbytes for p in mine),
                    sum(p.nbytes for p, _ in held))


def send_version(link: SendLink, chunks: list[torch.nn.Module], arch: MoEArch,
                 buffer_bytes: int, deadline: float) -> Traffic:
    """Send this rank's slabs of the current weights; returns what moved."""
    tensors = {piece.name: tensor for piece, tensor in held_pieces(chunks, arch)}
    plan = schedule({(link.rank, dst): ts for dst, ts in link.routes.items()}, buffer_bytes)
    traffic = Traffic()
    send_messages(link.group, link.rank, plan, tensors, group_device(link.spec.backend),
                  deadline, traffic)
    return traffic
