"""Seconds per weight version: the stream's own plan for two layouts, over given links.

`layout_pieces` describes what every rank of a layout holds without building the
model, in the sharding kinds of the memory model (`planning.stages`): per decoder
layer a block every tensor-parallel rank holds whole (norms, router, MLA
down-projections), a block cut over tp (attention up/out projections, dense and
shared-expert FFNs), and each routed expert (cut over etp); the embedding and output
head cut over tp. A trainer rank then keeps its owned share (`shard_plan.owned`, the
rule the stream uses), and routes, messages and loads follow from `parallel.shard_plan`
as for the real stream (`stream_loads`). One engine replica is planned: every replica
takes the same, so a sender's load is that times the number of engines.

A version (`version_time`) over `Links`:
    send     the busiest sender: bytes out / link + messages x latency
    receive  the busiest receiver: bytes in / the slower of its link and its copy into
             host staging + messages x latency
    shared   all bytes / what the links carry together (one machine's shared cores;
             no such limit on a cluster, where every GPU has its own NIC)
    wire     max(send, receive, shared): the links work at once, the slowest sets it
    install  the busiest receiver's shard into its weights, between two batches
    total    wire + install
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from moerl.models.arch import MoEArch
from moerl.parallel.layout import ParallelLayout
from moerl.parallel.shard_messages import Load, loads, schedule
from moerl.parallel.shard_plan import Piece, by_name, first_senders, owned, routes_to
from moerl.planning.stages import attention_split, stage_chunks


@dataclass(frozen=True)
class Coordinates:
    """Where rank `rank` of a layout sits: pipeline stage, tensor and expert ranks, and
    its index among the ranks of its stage holding the same dense / expert pieces."""

    pp: int
    tp: int
    dense_replica: int  # over cp x dp
    ep: int
    etp: int
    expert_replica: int  # over expert-dp


def coordinates(layout: ParallelLayout, rank: int) -> Coordinates:
    """Megatron's order: tp fastest, then cp and dp, pp slowest; experts etp, ep, edp."""
    per_stage = layout.world_size // layout.pp
    inside = rank % per_stage
    return Coordinates(rank // per_stage, inside % layout.tp, inside // layout.tp,
                       inside // layout.etp % layout.ep, inside % layout.etp,
                       inside // (layout.etp * layout.ep))


_ROUND = 64  # block sizes are rounded up to this many elements, so any tp, etp dividing
# it cuts the same block in both layouts


def _cut(name: str, size: int, parts: int, index: int, dtype: str) -> Piece:
    """A 1-d block of about `size` elements cut in `parts`."""
    if _ROUND % parts:
        raise ValueError(f"{name}: a cut in {parts} (tp or etp) must divide {_ROUND}")
    rounded = -(-size // _ROUND) * _ROUND
    step = rounded // parts
    return Piece(name, dtype, (rounded,), 0, ((index * step, (index + 1) * step),))


def _layer(arch: MoEArch, layout: ParallelLayout, where: Coordinates, layer: int,
           dtype: str) -> Iterator[Piece]:
    h, prefix = arch.hidden_size, f"layers.{layer}"
    whole, tensor = attention_split(arch)
    if arch.is_moe_layer(layer):
        whole += h * arch.num_experts + h  # router, pre-FFN norm
        tensor += 3 * h * arch.shared_expert_ffn_hidden_size
        per_rank = arch.num_experts // layout.ep
        for e in range(where.ep * per_rank, (where.ep + 1) * per_rank):
            yield _cut(f"{prefix}.experts.{e}", 3 * h * arch.moe_ffn_hidden_size, layout.etp,
                       where.etp, dtype)
    else:
        whole, tensor = whole + h, tensor + 3 * h * arch.ffn_hidden_size
    yield Piece.whole(f"{prefix}.whole", dtype, (whole,))
    yield _cut(f"{prefix}.tensor", tensor, layout.tp, where.tp, dtype)


def rank_pieces(arch: MoEArch, layout: ParallelLayout, rank: int, dtype: str) -> list[Piece]:
    """What rank `rank` of `layout` holds (MTP layers left out)."""
    where = coordinates(layout, rank)
    table = arch.vocab_size * arch.hidden_size
    out = [p for chunk in stage_chunks(arch, layout, where.pp) for layer in chunk
           for p in _layer(arch, layout, where, layer, dtype)]
    if where.pp == 0:
        out.append(_cut("embedding", table, layout.tp, where.tp, dtype))
    if where.pp == layout.pp - 1:
        out.append(Piece.whole("final_norm", dtype, (arch.hidden_size,)))
        if arch.untie_embeddings or layout.pp > 1:  # tied: the same table, sent once
            head = "output" if arch.untie_embeddings else "embedding"
            out.append(_cut(head, table, layout.tp, where.tp, dtype))
    return out


def owned_pieces(arch: MoEArch, layout: ParallelLayout, rank: int, dtype: str) -> list[Piece]:
    """The share of `rank_pieces` this trainer rank sends."""
    where = coordinates(layout, rank)
    dense_n = layout.world_size // layout.pp // layout.tp
    expert_n = layout.expert_dp

    def replica(piece: Piece) -> tuple[int, int, str]:
        if ".experts." in piece.name:
            if piece.cut:
                return where.expert_replica, expert_n, "expert/cut"
            return (where.expert_replica * layout.etp + where.etp, expert_n * layout.etp,
                    "expert")
        if piece.cut:
            return where.dense_replica, dense_n, "dense/cut"
        return where.dense_replica * layout.tp + where.tp, dense_n * layout.tp, "dense"

    return [part for _, part in owned(rank_pieces(arch, layout, rank, dtype), replica)]


@dataclass(frozen=True)
class StreamLoads:
    """Each sender's and each receiver's load of one version, and what each receiver
    holds (bytes)."""

    senders: dict[int, Load]
    receivers: dict[int, Load]
    held: dict[int, int]


def stream_loads(arch: MoEArch, trainer: ParallelLayout, engine: ParallelLayout,
                 engines: int, buffer_bytes: int, dtype: str = "bfloat16") -> StreamLoads:
    """The loads of a version from `trainer` into `engines` replicas of `engine`."""
    offered = by_name(first_senders({r: owned_pieces(arch, trainer, r, dtype)
                                     for r in range(trainer.world_size)}))
    base = trainer.world_size  # engine ranks come after the trainer's in the group
    pairs = {}
    held = {}
    for rank in range(engine.world_size):
        mine = rank_pieces(arch, engine, rank, dtype)
        held[base + rank] = sum(p.nbytes for p in mine)
        for src, transfers in routes_to(mine, offered).items():
            pairs[(src, base + rank)] = transfers
    load = loads(schedule(pairs, buffer_bytes))
    out = {r: Load(**{k: v * engines for k, v in load[r].__dict__.items()})
           for r in range(trainer.world_size) if r in load}
    return StreamLoads(out, {r: load[r] for r in held}, held)


@dataclass(frozen=True)
class Links:
    """What a version's transfers run over (bytes/s, seconds)."""

    bandwidth: float  # one rank's link, each way
    latency: float  # per message
    staging: float = math.inf  # a receiver's copy of what arrives into host staging
    shared: float = math.inf  # all links together (one machine's shared cores)
    install: float = math.inf  # a receiver's staged shard into its weights


@dataclass(frozen=True)
class VersionTime:
    send: float
    receive: float
    shared: float
    install: float

    @property
    def wire(self) -> float:
        return max(self.send, self.receive, self.shared)

    @property
    def total(self) -> float:
        return self.wire + self.install


def version_time(plan: StreamLoads, links: Links) -> VersionTime:
    send = max((s.bytes_sent / links.bandwidth + s.messages_sent * links.latency
                for s in plan.senders.values()), default=0.0)
    into = min(links.bandwidth, links.staging)
    receive = max((r.bytes_received / into + r.messages_received * links.latency
                   for r in plan.receivers.values()), default=0.0)
    total = sum(s.bytes_sent for s in plan.senders.values())
    return VersionTime(send, receive, total / links.shared,
                       max(plan.held.values(), default=0) / links.install)
