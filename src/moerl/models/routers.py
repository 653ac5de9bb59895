"""The MoE routers of a Megatron model, found by layer (the trainer's routing replay and
the rollout engine's capture of the experts it routed to both index them this way)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.transformer.moe.router import TopKRouter


def decoder_routers(chunks: Sequence[torch.nn.Module]) -> dict[int, TopKRouter]:
    """The decoder's routers held by this rank, by their 1-based global layer number
    (MTP layers' routers are left out: an engine does not run them)."""
    found: dict[int, TopKRouter] = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter) and not module.is_mtp_layer:
                found[int(module.layer_number)] = module
    return found


def top_k_ids(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """(tokens, E) bool map with `topk` experts a token -> (tokens, topk) expert ids,
    ascending (a replayed router gathers its probabilities at them, in any order)."""
    ids = routing_map.nonzero()[:, 1]
    if ids.numel() != routing_map.shape[0] * topk:
        raise RuntimeError(f"a router chose {ids.numel()} experts for {routing_map.shape[0]} "
                           f"tokens, expected {topk} each (token dropping is not captured)")
    return ids.reshape(routing_map.shape[0], topk)
