"""The `rollout` config group: the generation servers, whichever engine serves them.

Imports nothing heavy: the launcher reads it to start servers, and the rollout
backends (`backends.py`) turn it into vLLM / SGLang command lines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class RolloutClientConfig:
    """`rollout.client`: how the trainer calls the rollout servers (rollout/client.py)."""

    timeout_s: float = 600.0  # one group's generation, end to end
    connect_timeout_s: float = 5.0
    max_attempts: int = 4
    backoff_base_s: float = 0.5  # first retry waits up to this; doubles each time
    backoff_cap_s: float = 8.0
    max_in_flight: int = 64  # concurrent calls over all servers
    prompts_per_call: int = 32  # at most; prompts are also spread evenly over live servers
    model: str | None = None


@dataclass
class RolloutStageConfig:
    """The `rollout` group: the generation servers, and the trainer's client of them."""

    servers: int = 1
    # moerl engine: continuous, sequences at once (0: as many as the KV cache holds);
    # static, rows (prompt x sample) per batch (0: 32)
    max_batch: int = 0
    backend: Literal["auto", "continuous", "static", "dynamic"] = "auto"
    kv_cache_gb: float = 0.0  # continuous: KV cache per rank (0: 1 GiB on CPU, half a GPU's free)
    prefill_chunk: int = 2048  # continuous: tokens per forward (longer prompts are chunked)
    nodes: int = 1
    gpus_per_node: int = 0
    speculative: Literal["none", "ngram", "mtp"] = "none"  # draft-and-verify decoding
    num_draft_tokens: int = 4
    # With rl.mode=async: a weight update lands between two decode steps of the running
    # batch instead of after it; every token records the version that sampled it, and
    # the trainer masks tokens past rl.max_staleness (moerl engine: continuous backend, or
    # static on one rank).
    partial_rollouts: bool = False
    engine: str = "moerl"  # moerl | vllm | sglang (see rl.rollout.backends)
    # vllm / sglang only: they serve Hugging Face weights (`moerl hf export`).
    hf_model_dir: str | None = None
    # Each server's layout, every engine: moerl runs a server of pp x lcm(tp, ep) ranks
    # under torchrun (`rollout.ranks`), vLLM / SGLang get their own flags. Pipeline
    # stages are for a model too large otherwise: a decode step passes them in turn.
    tensor_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    served_model_name: str | None = None
    gpu_memory_utilization: float = 0.85
    client: RolloutClientConfig = field(default_factory=RolloutClientConfig)


def server_ranks(cfg: RolloutStageConfig) -> int:
    """Ranks of one moerl rollout server: its pipeline stages times, per stage, tensor
    parallelism times the data-parallel replicas inside it that the experts need to
    spread over `expert_parallel` ranks."""
    for name in ("tensor_parallel", "expert_parallel", "pipeline_parallel"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"rollout.{name}: must be >= 1, got {getattr(cfg, name)}")
    return cfg.pipeline_parallel * math.lcm(cfg.tensor_parallel, cfg.expert_parallel)


@dataclass(frozen=True)
class ServerRanks:
    """Where one moerl rollout server's ranks run: `span` nodes of `ranks_per_node`
    ranks each (torchrun on each node), and the server flags that match."""

    ranks_per_node: int
    span: int
    flags: tuple[str, ...]


def server_ranks_layout(cfg: RolloutStageConfig) -> ServerRanks:
    """One rank: no flags. More: `--tp/--ep/--pp` and the backend, on one node when
    they fit its GPUs (`rollout.gpus_per_node`, 0: this machine), else across
    ranks / gpus_per_node whole nodes per server (on a cluster). Across ranks the
    continuous decoder serves with data-parallel attention; pipeline stages need the
    static one."""
    ranks = server_ranks(cfg)
    if ranks == 1:
        return ServerRanks(1, 1, ())
    if cfg.speculative != "none" or cfg.backend == "dynamic":
        raise ValueError(
            f"rollout.tensor/expert/pipeline_parallel: a server across ranks runs the "
            f"continuous or static decoder; set rollout.backend=continuous (got "
            f"{cfg.backend!r}) and rollout.speculative=none (got {cfg.speculative!r}), or "
            "serve on one rank")
    if cfg.pipeline_parallel > 1 and cfg.backend == "continuous":
        raise ValueError("rollout.pipeline_parallel > 1 runs the static decoder; set "
                         "rollout.backend=static (or auto)")
    flags = ("--tp", str(cfg.tensor_parallel), "--ep", str(cfg.expert_parallel),
             *(("--pp", str(cfg.pipeline_parallel)) if cfg.pipeline_parallel > 1 else ()),
             "--backend", cfg.backend)
    per_node = cfg.gpus_per_node
    if not per_node or ranks <= per_node:
        return ServerRanks(ranks, 1, flags)
    if ranks % per_node:
        raise ValueError(
            f"rollout.tensor_parallel / rollout.expert_parallel: a server of {ranks} ranks "
            f"spans whole nodes of {per_node} GPUs (rollout.gpus_per_node); choose sizes "
            f"whose lcm is a multiple of {per_node}")
    span = ranks // per_node
    if cfg.nodes != cfg.servers * span:
        raise ValueError(
            f"rollout.nodes={cfg.nodes}: {cfg.servers} server(s) of {ranks} ranks on nodes "
            f"of {per_node} GPUs need rollout.nodes={cfg.servers * span}")
    return ServerRanks(per_node, span, flags)
