"""The rollout server across ranks: one model split over the ranks of a torchrun job.

`moerl serve rollout --tp T --ep E --pp P` under torchrun builds the policy with a
`ParallelLayout` of its own (tensor, expert and pipeline parallelism; every other
rank count is data parallelism inside the server, which runs the same batch on each
replica). Rank 0, the leader, serves HTTP. Every batch and weight update it runs is
first sent to the other ranks (followers) over a gloo group of its own, and all ranks
run it together: the same rows in the same order, the same forwards (their
collectives and the pipeline's sends pair up), each rank loading only its shard of a
published weight version. The ranks holding logits sample; then every rank takes the
tokens and logprobs of one of them, the source (the leader, or with pipeline stages
the last stage of the leader's pipeline), so no rank can drift from the sequence the
leader answers with.

Pipeline stages hold a model too large for one stage's ranks; each decode step
passes through them in turn (one token at a time, so a stage idles while the others
compute): use them for memory, tensor and expert parallelism for speed.

The continuous engine (`continuous_runner`) instead gives each attention replica (the
ranks of one data-parallel index) requests of its own: its commands are `tick`s, each
rank reports what its replica finished (`gather_reports`), and the ranks of a replica
take the tokens sampled by its first rank (`agree_in_replica`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from moerl.parallel.layout import LayoutError, ModelShape, ParallelLayout
from moerl.rollout.types import GenerationRequest
from moerl.rollout.weight_group import GroupSpec, Manifest


class WeightLoadError(RuntimeError):
    """A weight update failed; the previous weights and version are still served."""

log = logging.getLogger(__name__)

# A follower waits for the leader's next command as long as the server is idle.
_IDLE_FOREVER = timedelta(days=365)


def serving_layout(arch: ModelShape, world_size: int, tp: int = 1, ep: int = 1,
                   pp: int = 1) -> ParallelLayout:
    """The server's layout on `world_size` ranks: `tp` x `ep` x `pp`, the rest data
    parallel.

    Checked by the trainer's rules, then built without sequence parallelism: a decode
    step holds one token per row, which cannot be split over TP ranks (Megatron's MoE
    layers then take every token on each TP rank, as its own inference does)."""
    if world_size % (tp * pp):
        raise LayoutError(f"rollout: {world_size} server ranks cannot hold tp={tp} x pp={pp}; "
                          "start a multiple of tp x pp ranks per server")
    layout = ParallelLayout.for_world(world_size, tp=tp, ep=ep, pp=pp)
    layout.check(arch, world_size)
    layout.sequence_parallel = False
    return layout


@dataclass(frozen=True)
class Command:
    """What the leader sends before it runs something on the model."""

    kind: Literal["generate", "tick", "load", "join", "receive", "stop"]
    requests: tuple[GenerationRequest, ...] = ()  # generate: seeds filled in
    # tick: (replica, job, request index, request) assigned since the last tick, and
    # whether any rank has work (then every rank runs a forward)
    assignments: tuple[Any, ...] = ()
    forward: bool = False
    path: str = ""  # load: a published weights directory
    version: int = 0
    group: GroupSpec | None = None  # join: the trainer's weight group
    manifest: Manifest | None = None  # receive: the version the group will broadcast


class RolloutRanks:
    """The server's ranks and the leader's channel to them (every rank makes one)."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        self.group = dist.new_group(backend="gloo", timeout=_IDLE_FOREVER)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        # The rank whose samples every rank takes: the last stage of the leader's pipeline.
        box = [ps.get_pipeline_model_parallel_last_rank()]
        if self.size > 1:
            dist.broadcast_object_list(box, group=self.group, group_src=0)
        self.source = dist.get_group_rank(self.group, box[0])
        self._replica_groups()

    def _replica_groups(self) -> None:
        """Attention replicas: the ranks of each data-parallel index (group ranks, in
        order); a gloo group for each replica of several ranks."""
        from megatron.core import parallel_state as ps

        indices: list[int] = [0] * self.size
        dist.all_gather_object(indices, ps.get_data_parallel_rank(), group=self.group)
        self.replicas = max(indices) + 1
        self.replica = indices[self.rank]
        members = [[r for r in range(self.size) if indices[r] == i] for i in range(self.replicas)]
        self.replica_members = members[self.replica]
        self.replica_group: dist.ProcessGroup | None = None
        for group_ranks in members:  # every rank creates every group, in the same order
            if len(group_ranks) > 1:
                made = dist.new_group([dist.get_global_rank(self.group, r) for r in group_ranks],
                                      backend="gloo", timeout=_IDLE_FOREVER)
                if self.rank in group_ranks:
                    self.replica_group = made

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def reports_samples(self) -> bool:
        """The first rank of each replica reports its samples (the others hold the same)."""
        return self.rank == self.replica_members[0]

    def agree_in_replica(self, tokens: torch.Tensor | None, logprobs: torch.Tensor | None,
                         count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The replica's first rank's sampled tokens and logprobs, on each of its ranks."""
        assert tokens is not None and logprobs is not None, "every replica rank has logits"
        if self.replica_group is None:
            return tokens, logprobs
        both = torch.stack([tokens.double().cpu(), logprobs.double().cpu()])  # [2, count]
        dist.broadcast(both, group=self.replica_group, group_src=0)
        return both[0].to(tokens.device, torch.long), both[1].to(tokens.device, torch.float32)

    def gather_reports(self, report: Any) -> list[Any]:
        """Every rank's `report`, on the leader (a follower gets [])."""
        out: list[Any] | None = [None] * self.size if self.leader else None
        dist.gather_object(report, out, group=self.group, group_dst=0)
        return out or []

    def send(self, command: Command) -> None:
        """Leader: hand `command` to every follower."""
        if self.size > 1:
            dist.broadcast_object_list([command], group=self.group, group_src=0)

    def stop(self) -> None:
        """Leader, shutting down: tell the followers, unless a signal ended them first."""
        try:
            self.send(Command("stop"))
        except RuntimeError as exc:
            log.info("rollout ranks already stopped (%s)", exc)

    def receive(self) -> Command:
        """Follower: the leader's next command (waits while the server is idle)."""
        box: list[Command | None] = [None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        assert box[0] is not None
        return box[0]

    def agree_samples(self, tokens: torch.Tensor | None, logprobs: torch.Tensor | None,
                      count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The source's `count` sampled tokens and their logprobs, on every rank (a stage
        without logits passes None)."""
        if self.size == 1:
            assert tokens is not None and logprobs is not None
            return tokens, logprobs
        # float64 holds every token id exactly, and every float32 logprob.
        both = torch.empty(2, count, dtype=torch.float64)
        if self.rank == self.source:
            assert tokens is not None and logprobs is not None
            both[0], both[1] = tokens.cpu(), logprobs.cpu()
        dist.broadcast(both, group=self.group, group_src=self.source)
        device = tokens.device if tokens is not None else torch.device("cpu")
        return both[0].to(device, torch.long), both[1].to(device, torch.float32)

    def gather_counts(self, counts: dict[str, int]) -> list[dict[str, int]]:
        """Every rank's `counts` (the same keys on every rank), by server rank."""
        keys = sorted(counts)
        mine = torch.tensor([counts[k] for k in keys], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(everyone, mine, group=self.group)
        return [dict(zip(keys, (int(v) for v in t), strict=True)) for t in everyone]

    def all_ok(self, ok: bool) -> bool:
        """True on every rank when `ok` is true on every rank."""
        if self.size == 1:
            return ok
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())
