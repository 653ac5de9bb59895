"""The frozen reference model: the policy as RL started, for the KL terms.

    reference = Reference.build(arch, layout, groups, cfg, initial=policy.chunks)
    pairs = reference.logprobs(micro)   # (logprobs, entropy) per micro-batch, on every rank

Its weights are read from `weights` (where the run's initial policy is on disk) or copied
from the initial policy's chunks; they never train (eval mode, no gradients). With
`rl.routing_replay` its routers replay the rollout engine's experts, as the policy's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from moerl.data.rl_batch import RLMicroBatch
from moerl.models.arch import MoEArch
from moerl.models.build import build_model
from moerl.models.features import resolve_precision
from moerl.models.precision import ResolvedPrecision
from moerl.models.weights import load_weights
from moerl.parallel.groups import ParallelGroups
from moerl.parallel.layout import ParallelLayout
from moerl.rl.config import RLConfig
from moerl.rl.forward import ForwardHooks, forward_logprobs
from moerl.rl.routing import RoutingReplay

LogprobPair = tuple[torch.Tensor, torch.Tensor]  # (logprobs, entropy), each (B, T)


class Reference:
    """The reference model's chunks, frozen, its routing replay, and its logprobs."""

    def __init__(self, chunks: list[torch.nn.Module], arch: MoEArch, groups: ParallelGroups,
                 routing_replay: bool = False) -> None:
        for chunk in chunks:
            chunk.eval()
            chunk.requires_grad_(False)
        self.chunks, self.arch, self.groups = chunks, arch, groups
        self.replay = RoutingReplay(chunks, arch) if routing_replay else None

    @classmethod
    def build(
        cls,
        arch: MoEArch,
        layout: ParallelLayout,
        groups: ParallelGroups,
        cfg: RLConfig,
        initial: Sequence[torch.nn.Module],
        weights: str | Path | None = None,
        precision: ResolvedPrecision | None = None,
    ) -> Reference:
        """The model of `arch` in `layout`, loaded from `weights`, or else a copy of
        `initial` (the policy's chunks before any update). `precision`: the run's,
        resolved (None: this machine's default)."""
        precision = precision or resolve_precision()
        chunks = list(build_model(arch, layout, precision=precision, backend=groups.backend))
        if weights is not None:
            load_weights(chunks, weights)
        else:
            for ref, src in zip(chunks, initial, strict=True):
                ref.load_state_dict(src.state_dict())
        return cls(chunks, arch, groups, routing_replay=cfg.routing_replay)

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.groups.cp_group if self.groups.layout.cp > 1 else None

    def logprobs(self, micro: Sequence[RLMicroBatch]) -> list[LogprobPair]:
        """Per-token (logprobs, entropy) of the reference, on every rank (forward only)."""
        return forward_logprobs(
            self.chunks, micro, tp_group=self.groups.tp_group, device=self.groups.device,
            hooks=ForwardHooks(replay=self.replay), cp_group=self.cp_group,
        )
