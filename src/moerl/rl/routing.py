"""MoE routers of the policy: expert-load statistics and routing replay.

Both work per micro-batch on the tokens a router actually sees. The router input is
the layer's hidden states (S_local, B, H) flattened s-major to (S_local * B, H), where
S_local is this rank's sequence-parallel shard of the T positions; `_router_order` maps a
(B, T) per-position tensor into that order.

Load: a forward hook on each decoder router adds its routing map (tokens, E), restricted
to real (non-padding) tokens, into a (layers, E) count; `expert_load` sums it over the
ranks that hold different tokens of the same layer and over pipeline stages.

Replay (Megatron-Core 0.19 `RouterReplay`): with the action REPLAY_FORWARD a router uses
the given top-k expert ids instead of its own choice and gathers its probabilities at
them, so the trainer can recompute logprobs (and take gradients) through the experts
the rollout engine used. MTP layers are not replayed (the engine does not run them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch.utils.hooks import RemovableHandle

from moerl.models.arch import MoEArch
from moerl.models.routers import decoder_routers


def moe_layer_numbers(arch: MoEArch) -> list[int]:
    """1-based layer numbers of the MoE layers, in order (replay data is indexed by these)."""
    return [i + 1 for i in range(arch.num_layers) if arch.is_moe_layer(i)]


def _router_order(per_position: torch.Tensor, sp: bool) -> torch.Tensor:
    """(B, T, ...) -> (T_local * B, ...): this rank's shard, in the router's token order."""
    x = per_position.transpose(0, 1)  # (T, B, ...)
    if sp and ps.get_tensor_model_parallel_world_size() > 1:
        x = x.chunk(ps.get_tensor_model_parallel_world_size(), dim=0)[
            ps.get_tensor_model_parallel_rank()
        ]
    return x.reshape(-1, *per_position.shape[2:])


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer, counted by forward hooks."""

    def __init__(self, chunks: Sequence[torch.nn.Module], arch: MoEArch) -> None:
        self.arch = arch
        self.sp = bool(_config(chunks[0]).sequence_parallel)
        self.counts = torch.zeros(arch.num_layers, arch.num_experts, dtype=torch.float64)
        self.valid: torch.Tensor | None = None  # (T_local * B,) bool, for the next forward
        self.handles: list[RemovableHandle] = [
            router.register_forward_hook(self._hook(number))
            for number, router in decoder_routers(chunks).items()
        ]

    def set_tokens(self, valid: torch.Tensor | None) -> None:
        """valid (B, T) bool: real tokens of the micro-batch about to run forward; None
        stops counting."""
        self.valid = None if valid is None else _router_order(valid, self.sp).cpu()

    def reset(self) -> None:
        self.counts.zero_()

    def _hook(self, layer_number: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self.valid is None:  # a pass that does not count (logprob recomputation)
                return
            routing_map = output[1].detach().cpu()  # (tokens, E) bool
            if self.valid.shape[0] != routing_map.shape[0]:
                raise RuntimeError(
                    f"router saw {routing_map.shape[0]} tokens, expected {self.valid.shape[0]}"
                )
            routing_map = routing_map[self.valid]
            self.counts[layer_number - 1] += routing_map.sum(dim=0).double()

        return hook

    def totals(self) -> torch.Tensor:
        """(layers, E) counts over the global batch, the same on every rank."""
        counts = self.counts.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Ranks of one stage hold different tokens (dp, and tp shards under SP).
            group = (
                ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
                if self.sp
                else ps.get_data_parallel_group(with_context_parallel=True)
            )
            dist.all_reduce(counts, group=group)
            dist.all_reduce(counts, group=ps.get_pipeline_model_parallel_group())
        return counts

    def metrics(self) -> dict[str, float]:
        """Per MoE layer: max/mean tokens per expert (1 = balanced) and the busiest share."""
        counts = self.totals()
        out: dict[str, float] = {}
        for number in moe_layer_numbers(self.arch):
            row = counts[number - 1]
            total = float(row.sum())
            if total == 0:
                continue
            out[f"moe/layer{number}/max_over_mean"] = float(row.max() / row.mean())
            out[f"moe/layer{number}/max_share"] = float(row.max()) / total
        return out


def _config(chunk: torch.nn.Module) -> Any:
    return chunk.config


class RoutingReplay:
    """Feeds recorded expert choices to the decoder routers, one micro-batch at a time."""

    def __init__(self, chunks: Sequence[torch.nn.Module], arch: MoEArch) -> None:
        self.routers = decoder_routers(chunks)
        self.by_chunk = {id(c): decoder_routers([c]) for c in chunks}
        self.ordinal = {n: i for i, n in enumerate(moe_layer_numbers(arch))}
        self.sp = bool(_config(chunks[0]).sequence_parallel)
        for router in self.routers.values():
            if getattr(router, "router_replay", None) is None:
                # Models built without moe_enable_routing_replay: the router reads this
                # attribute on every call, so attaching one afterwards is enough.
                router.router_replay = RouterReplay()

    def arm(self, routed: torch.Tensor, chunk: torch.nn.Module) -> None:
        """routed (MoE layers, B, T, topk): expert ids of the micro-batch `chunk` runs next.

        Only that chunk's routers are armed: with virtual stages another chunk of this
        rank may be in the middle of a different micro-batch.
        """
        for number, router in self.by_chunk[id(chunk)].items():
            replay: RouterReplay = router.router_replay
            replay.clear_indices()
            idx = _router_order(routed[self.ordinal[number]], self.sp)  # (T_local * B, k)
            replay.set_target_indices(idx.to(router.weight.device))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def disarm(self) -> None:
        for router in self.routers.values():
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()

    def record(self) -> None:
        """Let the routers record their own choices on the next forward (tests, engines)."""
        for router in self.routers.values():
            router.router_replay.clear_indices()
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)

    def recorded(self) -> dict[int, torch.Tensor]:
        """Layer number -> (tokens, topk) ids recorded by the last forward."""
        return {n: r.router_replay.get_recorded_indices() for n, r in self.routers.items()}
