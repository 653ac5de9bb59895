"""SGLang and vLLM servers: whole Hugging Face tensors, broadcast from trainer rank 0.

Their update protocols take each tensor whole, in Hugging Face names and the served
dtype, in one broadcast from group rank 0 of the weight group (SGLang's
`update_weights_from_distributed`; vLLM's `load_weights`, called by moerl's worker
extension, which slices what its worker holds). So trainer rank 0 is the one sender
on the wire to the servers, and every server rank receives the whole model, not its
slices (the cost is in the README, "Weight sync"). Rank 0 still never holds the
model: the trainer ranks send it the pieces they own (the same balanced shares as
moerl's stream) over a group of the trainer ranks' own, tensor by tensor in the
order of the broadcast, through two staging buffers each (`Assembly`, planned once
when the groups form); rank 0 converts each Megatron tensor as soon as it is whole
(`models.hf_mapping.to_hf`), broadcasts the result and lets it go. At most a few
whole tensors are on rank 0 at once, plus the embedding and output head while MTP
layers still need their copies.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moerl.models.arch import MoEArch
from moerl.models.hf import cast_hf, hf_config
from moerl.models.hf_mapping import mtp_copies, rules, to_hf
from moerl.models.pieces import held_pieces, owned_pieces
from moerl.parallel.shard_messages import Message, messages
from moerl.parallel.shard_plan import Piece, PlanError, overlap
from moerl.rollout.weight_group import (
    GroupSpec,
    TensorSpec,
    WeightGroup,
    broadcast,
    dtype_of,
    group_device,
    join_with_plan,
    spec_of,
)
from moerl.rollout.weight_transport import Traffic, receive_messages, send_messages

Convert = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


@dataclass
class Assembly:
    """The trainer ranks' own group for one weight group of SGLang or vLLM servers,
    and a version's messages to rank 0 (alike on every trainer rank)."""

    group: WeightGroup
    spec: GroupSpec
    rank: int
    plan: list[Message]
    wholes: dict[str, Piece]  # every Megatron tensor's whole shape and dtype


def gather_plan(senders: Mapping[int, list[Piece]], order: list[str], buffer_bytes: int
                ) -> tuple[list[Message], dict[str, Piece]]:
    """Every owner's pieces to rank 0, tensor by tensor in `order`, then owner by owner."""
    offered: dict[str, list[tuple[int, Piece]]] = defaultdict(list)
    for rank in sorted(senders):
        for piece in senders[rank]:
            offered[piece.name].append((rank, piece))
    plan: list[Message] = []
    sent: dict[int, int] = defaultdict(int)  # messages per sender so far: the next tag
    wholes: dict[str, Piece] = {}
    for name in order:
        if name not in offered:
            raise PlanError(f"{name}: no trainer rank holds it; the served Hugging Face layout "
                            "needs it")
        first = offered[name][0][1]
        whole = wholes[name] = Piece.whole(name, first.dtype, first.shape)
        covered = 0
        for rank, piece in offered[name]:
            transfers = overlap(piece, whole)
            covered += sum(t.nbytes for t in transfers)
            for parts in messages(transfers, buffer_bytes):
                plan.append(Message(rank, 0, sent[rank], tuple(parts)))
                sent[rank] += 1
        if covered != whole.nbytes:
            raise PlanError(f"{name}: the trainer ranks hold {covered} of its {whole.nbytes} "
                            "bytes")
    return plan, wholes


def join_sources(spec: GroupSpec, rank: int, chunks: list[torch.nn.Module], arch: MoEArch,
                 buffer_bytes: int) -> Assembly:
    """Every trainer rank: join the trainer ranks' group and agree the plan."""
    offered = [p for p, _ in owned_pieces(held_pieces(chunks, arch))]
    order = [rule.megatron for rule in rules(arch)]
    group, (plan, wholes) = join_with_plan(
        spec, rank, offered, [], lambda senders, _: gather_plan(senders, order, buffer_bytes))
    return Assembly(group, spec, rank, plan, wholes)


def converter(arch: MoEArch, base_config: dict[str, Any] | None,
              dtype: torch.dtype | None) -> Convert:
    """Megatron name and whole tensor -> its Hugging Face tensors in the served dtype."""
    interleave = bool(hf_config(arch, base_config).get("rope_interleave", True))
    by_name = {rule.megatron: rule for rule in rules(arch)}

    def convert(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        parts = to_hf(by_name[name], tensor, arch, interleave)
        return [(k, cast_hf(k, v, dtype)) for k, v in parts.items()]

    return convert


def hf_stream(arch: MoEArch, convert: Convert, whole: Callable[[str], torch.Tensor]
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors in broadcast order, from each Megatron tensor whole."""
    for rule in rules(arch):
        yield from convert(rule.megatron, whole(rule.megatron))
    for hf_name, megatron in mtp_copies(arch).items():  # repeated in each MTP layer
        yield hf_name, convert(megatron, whole(megatron))[0][1]


def announced(assembly: Assembly, arch: MoEArch, convert: Convert) -> list[TensorSpec]:
    """Names, dtypes and shapes of what rank 0 will broadcast: the same conversion, on
    tensors with no storage."""
    def meta(name: str) -> torch.Tensor:
        w = assembly.wholes[name]
        return torch.empty(w.shape, dtype=dtype_of(w.dtype), device="meta")

    return [spec_of(name, tensor) for name, tensor in hf_stream(arch, convert, meta)]


def send_pieces(assembly: Assembly, chunks: list[torch.nn.Module], arch: MoEArch,
                deadline: float) -> Traffic:
    """A trainer rank other than 0: its owned pieces to rank 0, in the plan's order."""
    tensors = {p.name: t for p, t in held_pieces(chunks, arch)}
    traffic = Traffic()
    send_messages(assembly.group, assembly.rank, assembly.plan, tensors,
                  group_device(assembly.spec.backend), deadline, traffic)
    return traffic


def assemble_and_broadcast(assembly: Assembly, chunks: list[torch.nn.Module], arch: MoEArch,
                           servers: WeightGroup, convert: Convert, deadline: float) -> Traffic:
    """Rank 0: each tensor as its pieces arrive, converted and broadcast to the servers."""
    device = group_device(assembly.spec.backend)
    own = {p.name: t for p, t in held_pieces(chunks, arch)}
    kept = set(mtp_copies(arch).values())  # wanted again at the end
    order = [rule.megatron for rule in rules(arch)]
    left = {name: assembly.wholes[name].nbytes for name in order}
    whole: dict[str, torch.Tensor] = {}
    traffic = Traffic()

    def fill(name: str) -> torch.Tensor:
        if name not in whole:
            w = assembly.wholes[name]
            whole[name] = torch.empty(w.shape, dtype=dtype_of(w.dtype), device=device)
        return whole[name]

    def landed(message: Message) -> None:
        for part in message.parts:
            left[part.name] -= part.nbytes
            if left[part.name] == 0:
                for _, tensor in convert(part.name, whole[part.name]):
                    broadcast(servers, tensor.contiguous(), deadline)
                if part.name not in kept:
                    del whole[part.name]

    receive_messages(assembly.group, 0, assembly.plan, fill, device, deadline, traffic,
                     own=own, done=landed)
    for megatron in mtp_copies(arch).values():
        broadcast(servers, convert(megatron, whole[megatron])[0][1].contiguous(), deadline)
    return traffic
