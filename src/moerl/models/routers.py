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


def _count_real_tokens(router: TopKRouter, routing_map: torch.Tensor,
                       padding_mask: torch.Tensor | None = None) -> None:
    """`TopKRouter._apply_expert_bias` that can take the padding mask the router passes it:
    routing_map (tokens, E), padding_mask (tokens,) True where a token is padding."""
    if router.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                if padding_mask.dim() < routing_map.dim():
                    padding_mask = padding_mask.reshape(-1, 1)
                routing_map = routing_map & ~padding_mask
            router.local_tokens_per_expert += routing_map.sum(dim=0)


def count_only_real_tokens() -> None:
    """The expert bias's token counts leave padding out. The trainer passes each
    micro-batch's padding as GPTModel's `padding_mask`; megatron-core 0.19's router
    flattens it to (tokens,) and masks the (tokens, E) routing map with it, which cannot
    broadcast. Without the mask, padding rows' tokens are counted, and the bias update
    depends on how a layout pads its micro-batches. Idempotent."""
    TopKRouter._apply_expert_bias = _count_real_tokens
