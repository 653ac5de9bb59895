"""Per-GPU memory of a training rank: each term named, for one model, layout and run.

Static terms follow Megatron-Core's mixed-precision bookkeeping, per parameter P
held by the rank:

    weights         2 bytes (bf16) or 1 byte (fp8 primary weights through TE)
    main_grads      4 bytes: the fp32 gradient buffer DDP keeps, never sharded
    master_weights  4 bytes fp32 copy }  divided by the data-parallel size d when the
    adam_states     8 bytes (m and v) }  distributed optimizer is on (12/d), else 12

(fp32 runs, as on CPU: 4-byte weights optimized in place, no master copy.)

so 18 bytes/param without and 6 + 12/d with the distributed optimizer (bf16), as in
Megatron's distributed-optimizer notes. Dense parameters shard over dp*cp, routed
experts over the expert-data-parallel group. With FP8 primary weights only the linear
layers' weights take one byte; embeddings, norms and routers stay in bf16.

What else the trainer builds at start-up, each a term of its own:

    reference_weights   the frozen reference model (`rl.policy`: `use_reference`), the
                        policy's layout and precision: its weights only (no gradients,
                        no optimizer)
    critic_*            PPO's value model (`rl.advantage=gae`): the policy's trunk in the
                        same layout without output layer and MTP, a (1, h) head, with
                        its own gradient buffer and optimizer state (the four terms above)

Activations use the accounting of Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2022): count every tensor autograd saves
per token and layer, divide sequence-parallel regions and head-split tensors by tp,
and assume flash attention (no s x s score matrix). It is adapted here to multi-latent
attention (latents, the shared rotary key, per-head Q/K/V) and to MoE layers (router
scores in fp32, a shared expert, and k copies of each token through the routed
experts). `activations.py` holds those per-layer formulas.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace
from typing import Literal

from moerl.models.arch import MoEArch
from moerl.parallel.layout import ParallelLayout
from moerl.planning.activations import (
    LayerSpec,
    Recompute,
    head_bytes,
    layer_activation_bytes,
    logits_bytes,
    tokens_per_rank,
)
from moerl.planning.stages import ParamSplit, stage_chunks, stage_params

Precision = Literal["bf16", "fp8", "fp32"]
# te: Transformer Engine's spec (GPU). local: Megatron's local spec (CPU), whose MLA
# down-projections are column-parallel (split over tp, not replicated) and whose
# unfused kernels keep more activations (activations.py).
GiB = 1024**3


@dataclass
class RunSettings:
    """What a training run does per step, as far as memory and time depend on it."""

    seq_length: int = 4096
    micro_batch_size: int = 1
    global_batch_size: int = 1024  # sequences per optimizer step
    precision: Precision = "bf16"  # fp8: fp8 primary weights, fp32 master copies
    layer_spec: LayerSpec = "te"
    recompute: Recompute = "selective"
    moe_capacity_factor: float | None = None  # None: dropless (dispatch sized worst case)
    kv_cache_tokens: int = 0  # colocated rollouts: tokens cached per model replica
    kv_cache_bytes: int = 2  # bytes per cached element (2 bf16, 1 fp8)
    runtime_reserve_gb: float = 3.0  # CUDA context, NCCL buffers, allocator slack
    reference: bool = True  # the frozen reference model every RL run builds
    critic: bool = False  # PPO's value model (rl.advantage=gae)

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


def primary_weight_bytes(split: ParamSplit, precision: Precision) -> float:
    """Bytes of the weights themselves: one byte for the linear layers' FP8 primary
    weights, two for the embeddings, norms and routers beside them; else every
    parameter at the precision's width."""
    if precision == "fp8":
        wide = split.embedding + split.high_precision
        return (split.total - wide) + 2.0 * wide
    return split.total * {"bf16": 2.0, "fp32": 4.0}[precision]


def weight_bytes(split: ParamSplit, layout: ParallelLayout, run: RunSettings) -> dict[str, float]:
    """weights, main_grads, master_weights and adam_states of one rank.

    With the distributed optimizer, optimizer state of dense parameters is divided by
    dp*cp and that of routed experts by the expert-data-parallel size.
    """
    held = split.total
    master = 0.0 if run.precision == "fp32" else 4.0
    dense_shards = layout.dp * layout.cp if layout.use_distributed_optimizer else 1
    expert_shards = layout.expert_dp if layout.use_distributed_optimizer else 1
    dense = split.total - split.expert
    sharded = dense / dense_shards + split.expert / expert_shards
    return {
        "weights": primary_weight_bytes(split, run.precision),
        "main_grads": float(held * 4),
        "master_weights": master * sharded,
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


def local_spec_split(arch: MoEArch, layout: ParallelLayout, split: ParamSplit,
                     mla_layers: int) -> ParamSplit:
    """`split` as the local spec shards it: MLA down-projections split over tp."""
    if arch.attention != "mla" or layout.tp == 1:
        return split
    h = arch.hidden_size
    down = h * ((arch.q_lora_rank or 0) + arch.kv_lora_rank + arch.qk_pos_emb_head_dim)
    moved = down * mla_layers
    return replace(split, replicated=split.replicated - moved,
                   tensor=split.tensor + moved / layout.tp)


def critic_split(arch: MoEArch, layout: ParallelLayout, rank: int) -> ParamSplit:
    """The value model's parameters on pipeline `rank` (`models.value`): the policy's
    architecture untied and without MTP, its output layer replaced by a (1, h) head
    with a bias."""
    value_arch = dataclasses.replace(arch, untie_embeddings=True, mtp_num_layers=0)
    split = stage_params(value_arch, layout, rank)
    if rank == layout.pp - 1:
        head = arch.hidden_size + 1
        split = split + ParamSplit(replicated=head, high_precision=head,
                                   embedding=-arch.vocab_size * arch.hidden_size / layout.tp)
    return split


def model_terms(arch: MoEArch, layout: ParallelLayout, run: RunSettings, rank: int
                ) -> tuple[dict[str, float], float]:
    """The static terms of what the trainer builds on pipeline `rank` (policy, reference,
    critic), and the policy's parameter count there."""
    chunks = stage_chunks(arch, layout, rank)
    layers = sum(len(chunk) for chunk in chunks)
    is_last = rank == layout.pp - 1
    split = stage_params(arch, layout, rank)
    if is_last and layout.pp > 1 and arch.mtp_num_layers:
        # MTP embeds the shifted tokens itself: with pp > 1 the last stage holds its own
        # copy of the word embeddings (vocab/tp x h), measured on Megatron-Core 0.19.
        split = split + ParamSplit(embedding=arch.vocab_size * arch.hidden_size / layout.tp)
    critic = critic_split(arch, layout, rank) if run.critic else None
    if run.layer_spec == "local":
        split = local_spec_split(arch, layout, split,
                                 layers + (arch.mtp_num_layers if is_last else 0))
        if critic is not None:
            critic = local_spec_split(arch, layout, critic, layers)
    terms = weight_bytes(split, layout, run)
    terms["reference_weights"] = (primary_weight_bytes(split, run.precision)
                                  if run.reference else 0.0)
    if critic is not None:
        terms.update({f"critic_{name}": value
                      for name, value in weight_bytes(critic, layout, run).items()})
    return terms, split.total


def _activation_terms(
    arch: MoEArch, layout: ParallelLayout, run: RunSettings, layers: list[int], is_last: bool
) -> tuple[float, float]:
    """(bytes one micro-batch keeps on this rank, full-recompute working set)."""
    width = 4 if run.precision == "fp32" else 2
    # The last stage also runs the MTP layers, each a copy of the last layer's kind.
    if is_last:
        layers = layers + [arch.num_layers - 1] * arch.mtp_num_layers
    # Every dense layer saves the same, and every MoE layer: evaluate each kind once.
    firsts = {arch.is_moe_layer(layer): layer for layer in reversed(layers)}
    kinds = {
        moe: layer_activation_bytes(arch, layout, run.seq_length, run.micro_batch_size,
                                    run.moe_capacity_factor, layer, run.recompute,
                                    width=width, spec=run.layer_spec)
        for moe, layer in firsts.items()
    }
    per_layer = [kinds[arch.is_moe_layer(layer)] for layer in layers]
    saved = sum(stored for stored, _ in per_layer)
    if is_last:
        saved += head_bytes(arch, layout, run.seq_length, run.micro_batch_size, width,
                            run.layer_spec)
    # Full recompute re-runs one layer in backward; that layer's whole activation set
    # is alive once, on top of the checkpoints every in-flight micro-batch keeps.
    working = max((peak for _, peak in per_layer), default=0.0)
    return saved, working if run.recompute == "full" else 0.0


def rank_memory(
    arch: MoEArch, layout: ParallelLayout, run: RunSettings, rank: int
) -> MemoryBreakdown:
    """The memory of pipeline rank `rank` (0-based), every term named."""
    layers = [layer for chunk in stage_chunks(arch, layout, rank) for layer in chunk]
    is_last = rank == layout.pp - 1
    micro_batches = run.micro_batches(layout.dp)
    in_flight = in_flight_micro_batches(layout, rank, micro_batches)
    width = 4 if run.precision == "fp32" else 2

    terms, params = model_terms(arch, layout, run, rank)
    saved, working = _activation_terms(arch, layout, run, layers, is_last)
    terms["activations"] = saved * in_flight
    terms["recompute_working_set"] = working
    terms["logits"] = logits_bytes(arch, layout, run.seq_length, run.micro_batch_size,
                                   width) if is_last else 0.0
    terms["moe_dispatch"] = dispatch_bytes(arch, layout, run) \
        if any(arch.is_moe_layer(i) for i in layers) else 0.0
    terms["kv_cache"] = kv_cache_bytes(arch, layout, run, len(layers))
    terms["runtime_reserve"] = run.runtime_reserve_gb * GiB
    return MemoryBreakdown(pipeline_rank=rank, terms=terms, params=params, in_flight=in_flight)


def memory_breakdown(arch: MoEArch, layout: ParallelLayout, run: RunSettings) -> MemoryBreakdown:
    """The most loaded pipeline rank's memory (every rank is evaluated)."""
    ranks = (rank_memory(arch, layout, run, rank) for rank in range(layout.pp))
    return max(ranks, key=lambda m: m.total)


def fits(breakdown: MemoryBreakdown, gpu_memory_gb: float, safety_margin: float) -> bool:
    """total <= gpu_memory * (1 - safety_margin)."""
    return breakdown.total <= gpu_memory_gb * GiB * (1.0 - safety_margin) and math.isfinite(
        breakdown.total
    )
