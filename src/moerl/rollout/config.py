"""The `rollout` config group: the generation servers, whichever engine serves them.

Imports nothing heavy: the launcher reads it to start servers, and the rollout
backends (`backends.py`) turn it into vLLM / SGLang command lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class RolloutStageConfig:
    """The `rollout` group: the generation servers."""

    servers: int = 1
    max_batch: int = 64  # rows (prompt x sample) per engine call
    backend: Literal["auto", "static", "dynamic"] = "auto"
    nodes: int = 1
    gpus_per_node: int = 0
    request_timeout_s: float = 600.0
    speculative: Literal["none", "ngram", "mtp"] = "none"  # draft-and-verify decoding
    num_draft_tokens: int = 4
    engine: str = "moerl"  # moerl | vllm | sglang (see rl.rollout.backends)
    # vllm / sglang only: they serve Hugging Face weights (`moerl hf export`).
    hf_model_dir: str | None = None
    tensor_parallel: int = 1
    expert_parallel: int = 1
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    served_model_name: str | None = None
    gpu_memory_utilization: float = 0.85
