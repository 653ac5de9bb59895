"""Per-GPU memory of a training rank: each term named, for one model, layout and run.

Static terms follow Megatron-Core's mixed-precision bookkeeping, per parameter P
held by the rank:

    weights         2 bytes (bf16) or 1 byte (fp8 primary weights through TE)
    main_grads      4 bytes: the fp32 gradient buffer DDP keeps, never sharded
    master_weights  4 bytes fp32 copy }  divided by the data-parallel size d when the
    adam_states     8 bytes (m and v) }  distributed optimizer is on (12/d), else 12

so 18 bytes/param without and 6 + 12/d with the distributed optimizer (bf16), as in
Megatron's distributed-optimizer notes. Dense parameters shard over dp*cp, routed
experts over the expert-data-parallel group.

Activations use the accounting of Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2022): count every tensor autograd saves
per token and layer, divide sequence-parallel regions and head-split tensors by tp,
and assume flash attention (no s x s score matrix). It is adapted here to multi-latent
attention (latents, the shared rotary key, per-head Q/K/V) and to MoE layers (router
scores in fp32, a shared expert, and k copies of each token through the routed
experts). `activations.py` holds those per-layer formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from moerl.models.arch import MoEArch
from moerl.parallel.activations import (
    Recompute,
    layer_activation_bytes,
    logits_bytes,
    tokens_per_rank,
)
from moerl.parallel.layout import ParallelLayout
from moerl.parallel.stages import ParamSplit, stage_chunks, stage_params

Precision = Literal["bf16", "fp8"]
GiB = 1024**3


@dataclass
class RunSettings:
    """What a training run does per step, as far as memory and time depend on it."""

    seq_length: int = 4096
    micro_batch_size: int = 1
    global_batch_size: int = 1024  # sequences per optimizer step
    precision: Precision = "bf16"  # fp8: fp8 primary weights, fp32 master copies
    recompute: Recompute = "selective"
    moe_capacity_factor: float | None = None  # None: dropless (dispatch sized worst case)
    kv_cache_tokens: int = 0  # colocated rollouts: tokens cached per model replica
    kv_cache_bytes: int = 2  # bytes per cached element (2 bf16, 1 fp8)
    runtime_reserve_gb: float = 3.0  # CUDA context, NCCL buffers, allocator slack

    def __post_init__(self) -> None:
        for name in ("seq_length", "micro_batch_size", "global_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"run.{name}: must be a positive integer")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ValueError("run.moe_capacity_factor: must be > 0, or null for dropless")

    def micro_batches(self, dp: int) -> int:
        """Micro-batches per step on each data-parallel rank: gbs / (mbs * dp)."""
        return max(self.global_batch_size // (self.micro_batch_size * dp), 1)


@dataclass
class MemoryBreakdown:
    """Bytes on one GPU, term by term; `total` is their sum."""

    pipeline_rank: int
    terms: dict[str, float] = field(default_factory=dict)
    params: float = 0.0  # parameters held by this rank (all kinds)
    in_flight: float = 0.0  # micro-batches of this rank's activations alive at the peak

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    def gib(self) -> dict[str, float]:
        return {name: value / GiB for name, value in self.terms.items()}


def weight_bytes(split: ParamSplit, layout: ParallelLayout, run: RunSettings) -> dict[str, float]:
    """weights, main_grads, master_weights and adam_states of one rank.

    With the distributed optimizer, optimizer state of dense parameters is divided by
    dp*cp and that of routed experts by the expert-data-parallel size.
    """
    held = split.total
    width = 1 if run.precision == "fp8" else 2
    dense_shards = layout.dp * layout.cp if layout.use_distributed_optimizer else 1
    expert_shards = layout.expert_dp if layout.use_distributed_optimizer else 1
    dense = split.total - split.expert
    sharded = dense / dense_shards + split.expert / expert_shards
    return {
        "weights": float(held * width),
        "main_grads": float(held * 4),
        "master_weights": 4.0 * sharded,
        "adam_states": 8.0 * sharded,
    }


def in_flight_micro_batches(layout: ParallelLayout, rank: int, micro_batches: int) -> float:
    """Micro-batches of activations pipeline rank `rank` holds at its peak.

    1F1B: rank i holds pp - i. Interleaved (vpp = v chunks per rank): Megatron warms
    up (pp - i - 1) * 2 + (v - 1) * pp chunks and then runs one more, each a 1/v slice
    of the rank's layers, so rank 0 holds pp + (pp - 1)/v micro-batches, the extra
    pp * (1 + (pp-1)/(pp*v)) of Korthikanti et al. Capped by the micro-batch count.
    """
    pp, v = layout.pp, layout.virtual_stages
    if v == 1:
        return float(min(pp - rank, micro_batches))
    chunks = (pp - rank - 1) * 2 + (v - 1) * pp + 1
    return min(chunks, micro_batches * v) / v


def dispatch_bytes(arch: MoEArch, layout: ParallelLayout, run: RunSettings) -> float:
    """All-to-all send and receive buffers of one MoE layer (transient, one at a time).

    Send: T*k*h elements for the rank's T tokens. Receive with capacity factor c:
    c*T*k*h. Dropless worst case: every token of the ep ranks picks this rank's
    experts, T * ep * min(k, E/ep) * h.
    """
    if arch.num_moe_layers == 0:
        return 0.0
    tokens = tokens_per_rank(layout, run.seq_length, run.micro_batch_size)
    k, h = arch.moe_router_topk, arch.hidden_size
    send = tokens * k * h
    if run.moe_capacity_factor is not None:
        recv = run.moe_capacity_factor * tokens * k * h
    else:
        recv = tokens * layout.ep * min(k, arch.num_experts // layout.ep) * h
    return 2.0 * (send + recv) * layout.etp


def kv_cache_bytes(arch: MoEArch, layout: ParallelLayout, run: RunSettings, layers: int) -> float:
    """KV cache of a colocated rollout engine for `layers` decoder layers on this rank.

    MLA caches the kv latent plus the shared rotary key per token and layer,
    (kv_lora_rank + qk_pos_emb_head_dim) elements, replicated over tp (it has no
    head dimension). GQA caches 2 * groups * kv_channels, split over tp.
    """
    if run.kv_cache_tokens == 0:
        return 0.0
    if arch.attention == "mla":
        per_token: float = arch.kv_lora_rank + arch.qk_pos_emb_head_dim
    else:
        groups = arch.num_query_groups or arch.num_attention_heads
        kv_channels = arch.kv_channels or arch.hidden_size // arch.num_attention_heads
        per_token = 2 * groups * kv_channels / layout.tp
    return float(run.kv_cache_tokens * layers * per_token * run.kv_cache_bytes)


def rank_memory(
    arch: MoEArch, layout: ParallelLayout, run: RunSettings, rank: int
) -> MemoryBreakdown:
    """The memory of pipeline rank `rank` (0-based), every term named."""
    split = stage_params(arch, layout, rank)
    chunks = stage_chunks(arch, layout, rank)
    layers = [layer for chunk in chunks for layer in chunk]
    is_last = rank == layout.pp - 1
    micro_batches = run.micro_batches(layout.dp)
    in_flight = in_flight_micro_batches(layout, rank, micro_batches)

    terms = weight_bytes(split, layout, run)
    # Every dense layer saves the same, and every MoE layer: evaluate each kind once.
    firsts = {arch.is_moe_layer(layer): layer for layer in reversed(layers)}
    kinds = {
        moe: layer_activation_bytes(arch, layout, run.seq_length, run.micro_batch_size,
                                    run.moe_capacity_factor, layer, run.recompute)
        for moe, layer in firsts.items()
    }
    per_layer = [kinds[arch.is_moe_layer(layer)] for layer in layers]
    saved = sum(stored for stored, _ in per_layer)
    # Full recompute re-runs one layer in backward; that layer's whole activation set
    # is alive once, on top of the checkpoints every in-flight micro-batch keeps.
    working = max((peak for _, peak in per_layer), default=0.0)
    terms["activations"] = saved * in_flight
    terms["recompute_working_set"] = working if run.recompute == "full" else 0.0
    terms["logits"] = logits_bytes(arch, layout, run.seq_length, run.micro_batch_size) \
        if is_last else 0.0
    terms["moe_dispatch"] = dispatch_bytes(arch, layout, run) \
        if any(arch.is_moe_layer(i) for i in layers) else 0.0
    terms["kv_cache"] = kv_cache_bytes(arch, layout, run, len(layers))
    terms["runtime_reserve"] = run.runtime_reserve_gb * GiB
    return MemoryBreakdown(pipeline_rank=rank, terms=terms, params=split.total,
                           in_flight=in_flight)


def memory_breakdown(arch: MoEArch, layout: ParallelLayout, run: RunSettings) -> MemoryBreakdown:
    """The most loaded pipeline rank's memory (every rank is evaluated)."""
    ranks = (rank_memory(arch, layout, run, rank) for rank in range(layout.pp))
    return max(ranks, key=lambda m: m.total)


def fits(breakdown: MemoryBreakdown, gpu_memory_gb: float, safety_margin: float) -> bool:
    """total <= gpu_memory * (1 - safety_margin)."""
    return breakdown.total <= gpu_memory_gb * GiB * (1.0 - safety_margin) and math.isfinite(
        breakdown.total
    )
