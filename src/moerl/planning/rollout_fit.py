"""How many inference engine replicas, of which TP/EP, fit on the rollout nodes.

An engine of n GPUs runs attention and dense layers with tensor parallelism t (inside
a node) and n/t attention data-parallel groups, and spreads the routed experts over
all n GPUs (EP = n), as vLLM and SGLang do for DeepSeek-style models. Per GPU:

    weights  = (replicated + tensor/t + embeddings/t + experts/n) * weight_bytes
    kv_free  = gpu_memory * memory_utilization - weights - activation_reserve
    tokens   = kv_free / (layers * per_token_layer_bytes) * (n / t)

per_token_layer_bytes is (kv_lora_rank + rope) * kv_bytes for MLA (the latent is
replicated over the t ranks, each attention group caches its own sequences), and
2 * groups * kv_channels / t * kv_bytes for GQA. An engine fits when its tokens hold
its share of the concurrent sequences at full context: ceil(sequences / replicas) *
context_length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moerl.models.arch import MoEArch
from moerl.parallel.layout import ParallelLayout
from moerl.planning.memory import GiB
from moerl.planning.stages import stage_params


@dataclass
class RolloutSettings:
    """The rollout side of a run: its nodes and the load they must carry."""

    nodes: int = 32
    concurrent_sequences: int = 2048  # sequences generated at once, all engines together
    context_length: int = 32768  # prompt + response tokens a sequence may reach
    weight_bytes: int = 1  # 1: fp8 serving weights (DeepSeek-V3 / Kimi-K2 ship fp8 blocks)
    kv_bytes: int = 2
    memory_utilization: float = 0.9
    activation_reserve_gb: float = 8.0  # CUDA graphs, activations, sampler


@dataclass(frozen=True)
class EngineFit:
    """One engine shape on the rollout nodes."""

    gpus: int
    tp: int
    ep: int
    replicas: int
    weights_gb: float
    kv_tokens: int  # per replica
    needed_tokens: int  # per replica
    fits: bool


def _engine_fit(
    arch: MoEArch, rollout: RolloutSettings, gpu_memory_gb: float, gpus: int, tp: int, total: int
) -> EngineFit:
    split = stage_params(arch, ParallelLayout(tp=tp, ep=gpus), 0)
    weights = split.total * rollout.weight_bytes
    free = gpu_memory_gb * GiB * rollout.memory_utilization - weights
    free -= rollout.activation_reserve_gb * GiB
    if arch.attention == "mla":
        per_token: float = (arch.kv_lora_rank + arch.qk_pos_emb_head_dim) * rollout.kv_bytes
    else:
        groups = arch.num_query_groups or arch.num_attention_heads
        kv_channels = arch.kv_channels or arch.hidden_size // arch.num_attention_heads
        per_token = 2 * groups * kv_channels / tp * rollout.kv_bytes
    per_gpu = max(free, 0.0) / (arch.num_layers * per_token)
    replicas = total // gpus
    needed = math.ceil(rollout.concurrent_sequences / replicas) * rollout.context_length
    kv_tokens = int(per_gpu * gpus / tp)
    return EngineFit(gpus, tp, gpus, replicas, weights / GiB, kv_tokens, needed,
                     free > 0 and kv_tokens >= needed)


def rollout_options(
    arch: MoEArch, rollout: RolloutSettings, gpus_per_node: int, gpu_memory_gb: float
) -> list[EngineFit]:
    """Every engine shape for the rollout nodes, fitting ones first, most replicas first."""
    total = rollout.nodes * gpus_per_node
    options = []
    gpus = 1
    while gpus <= total:
        for tp in (1, 2, 4, 8, 16):
            fits_tp = tp <= min(gpus, gpus_per_node) and gpus % tp == 0
            if fits_tp and arch.num_attention_heads % tp == 0 and arch.num_experts % gpus == 0:
                options.append(_engine_fit(arch, rollout, gpu_memory_gb, gpus, tp, total))
        gpus *= 2
    return sorted(options, key=lambda o: (not o.fits, -o.replicas, o.tp))
