"""A streamed weight version into one rank of a moerl rollout server: only the bytes
of the slices this rank holds, from the trainer ranks that hold them.

When the server joins a weight group (`join`) each of its ranks offers the pieces of
the model it holds (`models.pieces.held_pieces`) and learns the pieces every trainer
rank sends (`weight_group.exchange`: names, shapes and ranges, no tensors); from
both it computes once, for every version the group will carry, which trainer rank
sends it which slabs (`parallel.shard_plan.routes_to`), whatever the two layouts.
A plan that cannot be met (a tensor no trainer rank sends, shapes that differ)
refuses the join.

A version (`stage`) arrives into a fresh host copy of this rank's shard through the
transport's two staging buffers (`weight_transport.receive_messages`): the served
weights stay untouched, so a failure anywhere leaves the old version whole.
`install` then makes it the weights between two batches: on CPU the received
tensors become the parameters, on a GPU they are copied into the parameters' own
memory (the dynamic engine's CUDA graphs read those addresses). Either way the
previous version's memory is released: no spare copy of the weights is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moerl.models.arch import MoEArch
from moerl.models.pieces import held_pieces
from moerl.parallel.shard_messages import schedule
from moerl.parallel.shard_plan import Piece, Transfer, by_name, routes_to
from moerl.rollout.weight_group import (
    GroupSpec,
    Manifest,
    WeightGroup,
    group_device,
    join_with_plan,
)
from moerl.rollout.weight_transport import Traffic, receive_messages


@dataclass
class ReceiveLink:
    """This rank's place in a weight group and what it takes from each sender."""

    group: WeightGroup
    spec: GroupSpec
    rank: int  # in the group
    held: list[tuple[Piece, torch.Tensor]]  # (piece, the parameter holding it)
    routes: dict[int, list[Transfer]]  # sender's group rank -> its transfers, in order


def join(spec: GroupSpec, rank: int, model: torch.nn.Module, arch: MoEArch) -> ReceiveLink:
    """Join the group as `rank` and agree the plan with every member."""
    held = held_pieces([model], arch)
    mine = [p for p, _ in held]
    group, routes = join_with_plan(spec, rank, [], mine,
                                   lambda senders, _: routes_to(mine, by_name(senders)))
    return ReceiveLink(group, spec, rank, held, routes)


@dataclass
class Staged:
    """A received version on this rank: (parameter, its new value) for every weight it
    holds, and what the transport moved."""

    values: list[tuple[torch.Tensor, torch.Tensor]]
    traffic: Traffic
    held_bytes: int  # of this rank's own slices


def stage(link: ReceiveLink, manifest: Manifest) -> Staged:
    """Receive version `manifest.version` into host tensors of this rank's shard."""
    if manifest.group_name != link.spec.group_name:
        raise ValueError(f"version {manifest.version} is for weight group "
                         f"{manifest.group_name}, this rank joined {link.spec.group_name}")
    deadline = time.monotonic() + link.spec.timeout_s
    new = {p.name: torch.empty(p.local_shape, dtype=param.dtype) for p, param in link.held}
    plan = schedule({(src, link.rank): ts for src, ts in link.routes.items()},
                    manifest.buffer_bytes)
    traffic = Traffic()
    receive_messages(link.group, link.rank, plan, new.__getitem__,
                     group_device(link.spec.backend), deadline, traffic)
    return Staged([(param, new[p.name]) for p, param in link.held], traffic,
                  sum(p.nbytes for p, _ in link.held))


def install(staged: Staged) -> None:
    """Swap the staged values in (all of them, between two batches)."""
    with torch.no_grad():
        for param, value in staged.values:
            if param.device.type == "cpu" and value.dtype == param.dtype:
                param.data = value
            else:
                param.copy_(value)
    staged.values.clear()
