"""The Megatron engine's settings (`moerl serve rollout`'s flags), and which decoder runs.

Backends:
- `continuous` (the default where the dynamic engine cannot run, CPU included):
  continuous batching with chunked prefill over a paged KV cache (MLA's latent cache for
  MLA models), shared prompt prefixes, and across ranks data-parallel attention with
  expert parallelism (`continuous_decode`, `continuous_runner`).
- `dynamic`: Megatron's dynamic inference engine (a GPU with flash attention).
- `static`: batches decoded to completion on Megatron's static KV cache, kept for
  pipeline-parallel servers, speculative decoding (its own decoder) and comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moerl.rollout.speculative.config import SpeculativeConfig
from moerl.rollout.types import LogprobMode

Backend = Literal["auto", "continuous", "static", "dynamic"]
BACKENDS: tuple[str, ...] = ("auto", "continuous", "static", "dynamic")
STATIC_BATCH = 32  # rows per static batch when max_batch is 0


@dataclass(frozen=True)
class EngineOptions:
    max_batch: int = 0
    """Continuous and dynamic: sequences running at once (0: as many as the KV cache
    holds, up to 1024). Static: rows per batch (0: 32)."""
    backend: Backend = "auto"
    logprob_mode: LogprobMode = "policy"  # default for requests that do not say
    # Drafts verified by the policy (static backend); samples keep the policy's distribution.
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Partial rollouts: a weight update lands between two decode steps of running
    # generations, and every token records the version that sampled it.
    partial_rollouts: bool = False
    kv_cache_gb: float = 0.0
    """Continuous: the KV cache of each rank (0: 1 GiB on a CPU, half the free memory
    on a GPU). It decides how many sequences run at once."""
    block_size: int = 16  # continuous: tokens per KV cache block
    prefill_chunk: int = 2048
    """Continuous and dynamic: tokens per forward (decode tokens first, then prompt chunks)."""
    cuda_graphs: int = 16  # dynamic: CUDA graphs captured (Megatron's num_cuda_graphs; 0: none)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: one of {BACKENDS}, got {self.backend!r}")
        for name in ("max_batch", "kv_cache_gb", "cuda_graphs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (0: sized for you)")
        for name in ("block_size", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
