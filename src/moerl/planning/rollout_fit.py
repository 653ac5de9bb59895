"""How many rollout engines of which TP/EP fit the rollout nodes, and how many rows each holds.

An engine is one moerl rollout server across lcm(tp, ep) GPUs (`rollout.ranks`): tensor
parallelism t inside a node, the routed experts spread over ep GPUs, and every rank
running the same batch (the attention data-parallel replicas hold the same rows).
Per GPU, at the engine's serving precision:

    weights  = replicated + tensor/t + embeddings/t + experts/ep, at 1 byte for FP8
               primary weights (linear layers; embeddings, norms, routers at 2) or 2
    kv_free  = gpu_memory * memory_utilization - weights - activation_reserve
    tokens   = kv_free / (layers * kv_bytes_per_token_layer(t))

where kv_bytes_per_token_layer is the engine's own cache layout (`rollout.kv_layout`,
passed in: the planner does not import the rollout package). An engine holds
tokens // context_length rows at full context; it fits when that is at least its share
of the concurrent sequences, ceil(sequences / replicas): the engine's `max_batch`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from moerl.models.arch import MoEArch
from moerl.parallel.layout import ParallelLayout
from moerl.planning.memory import GiB, primary_weight_bytes
from moerl.planning.stages import stage_params

KVBytes = Callable[[MoEArch, int], float]
"""bytes one rank caches per token and decoder layer at tensor parallelism tp"""


@dataclass
class RolloutSettings:
    """The rollout side of a run: its nodes and the load they must carry."""

    nodes: int = 32
    concurrent_sequences: int = 2048  # sequences generated at once, all engines together
    context_length: int = 32768  # prompt + response tokens a sequence may reach
    weight_dtype: Literal["fp8", "bf16"] = "fp8"
    """The serving weights: the run's precision (fp8: the trainer's FP8 primary weights)."""
    memory_utilization: float = 0.9
    activation_reserve_gb: float = 8.0  # activations, logits, sampler, CUDA context

    def __post_init__(self) -> None:
        if min(self.nodes, self.concurrent_sequences, self.context_length) < 1:
            raise ValueError("rollout.nodes, rollout.concurrent_sequences and "
                             "rollout.context_length: must be >= 1")


@dataclass(frozen=True)
class EngineFit:
    """One engine shape on the rollout nodes."""

    gpus: int
    tp: int
    ep: int
    replicas: int
    weights_gb: float  # GiB per GPU
    kv_tokens: int  # tokens an engine caches (every one of its ranks holds them all)
    rows: int  # sequences at full context an engine holds at once
    needed_rows: int  # its share of the concurrent sequences: the engine's max_batch
    fits: bool


def engine_weight_bytes(arch: MoEArch, rollout: RolloutSettings, tp: int, ep: int) -> float:
    """Weight bytes on one GPU of an engine of tensor parallelism `tp`, experts over `ep`."""
    split = stage_params(arch, ParallelLayout(tp=tp, ep=ep, dp=max(ep // tp, 1)), 0)
    return primary_weight_bytes(split, rollout.weight_dtype)


def engine_rank_terms(arch: MoEArch, rollout: RolloutSettings, tp: int, ep: int, rows: int,
                      kv_bytes: KVBytes) -> dict[str, float]:
    """One GPU of an engine decoding `rows` sequences at full context, term by term."""
    kv = rows * rollout.context_length * arch.num_layers * kv_bytes(arch, tp)
    return {"weights": engine_weight_bytes(arch, rollout, tp, ep), "kv_cache": kv,
            "activation_reserve": rollout.activation_reserve_gb * GiB}


def _engine_fit(arch: MoEArch, rollout: RolloutSettings, gpu_memory_gb: float, tp: int,
                ep: int, total: int, kv_bytes: KVBytes) -> EngineFit:
    gpus = math.lcm(tp, ep)
    weights = engine_weight_bytes(arch, rollout, tp, ep)
    free = gpu_memory_gb * GiB * rollout.memory_utilization - weights
    free -= rollout.activation_reserve_gb * GiB
    tokens = int(max(free, 0.0) // (arch.num_layers * kv_bytes(arch, tp)))
    replicas = total // gpus
    needed = math.ceil(rollout.concurrent_sequences / replicas)
    rows = tokens // rollout.context_length
    return EngineFit(gpus, tp, ep, replicas, weights / GiB, tokens, rows, needed,
                     free > 0 and rows >= needed)


def rollout_options(arch: MoEArch, rollout: RolloutSettings, gpus_per_node: int,
                    gpu_memory_gb: float, kv_bytes: KVBytes) -> list[EngineFit]:
    """Every engine shape for the rollout nodes: fitting ones first, most replicas first;
    then the others, those caching the most tokens first; the smallest tp first."""
    total = rollout.nodes * gpus_per_node
    options = []
    ep = 1
    while ep <= total:
        for tp in (1, 2, 4, 8, 16):
            gpus = math.lcm(tp, ep)
            spans = gpus <= gpus_per_node or gpus % gpus_per_node == 0
            if (tp <= gpus_per_node and gpus <= total and spans
                    and arch.num_attention_heads % tp == 0 and arch.num_experts % ep == 0):
                options.append(_engine_fit(arch, rollout, gpu_memory_gb, tp, ep, total,
                                           kv_bytes))
        ep *= 2
    return sorted(options, key=lambda o: (not o.fits, -o.replicas if o.fits else 0,
                                          -o.kv_tokens, o.tp))
