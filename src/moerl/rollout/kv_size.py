"""What the continuous engine's KV cache holds per token, asked without building anything.

Multi-latent attention (DeepSeek-V3, Kimi-K2) caches, per token and layer, the
compressed kv latent after its norm (kv_lora_rank) and the rotary key shared by all
heads (qk_pos_emb_head_dim): the up-projections are absorbed into the query and the
output (`rollout.mla_attention`), so no per-head key or value is ever stored. That
latent has no head dimension: every tensor-parallel rank of an attention replica holds
all of it. Grouped-query attention caches each query group's key and value, split over
tensor-parallel ranks (a group is replicated when there are fewer groups than ranks).

With data-parallel attention every rank caches only the rows it serves, so a rank's
cache is its own tokens times this. `kv_bytes_per_token` is the number the planner and
the rehearsal size rollout engines with; `rollout.paged_cache.PagedKVCache` allocates
exactly `kv_elements_per_token_layer` elements per token and layer (a test holds the two
equal). No torch here: the planner's commands import it.
"""

from __future__ import annotations

import math

from moerl.models.arch import MoEArch

_DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1,
}


def dtype_bytes(dtype: object) -> int:
    """Bytes of one element of `dtype`: a name ("bfloat16", "fp8", ...), a torch dtype
    (read by its name, so torch is not imported) or a byte count."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype not in (1, 2, 4):
            raise ValueError(f"dtype: {dtype} bytes per element; use 1, 2 or 4")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype: unknown KV cache dtype {dtype!r}; use one of "
                         f"{', '.join(sorted(_DTYPE_BYTES))}")
    return _DTYPE_BYTES[name]


def kv_groups_per_rank(arch: MoEArch, tp: int = 1) -> int:
    """GQA: the query groups one tensor-parallel rank caches (at least one)."""
    groups = arch.num_query_groups or arch.num_attention_heads
    return max(1, math.ceil(groups / tp))


def gqa_head_dim(arch: MoEArch) -> int:
    return arch.kv_channels or arch.hidden_size // arch.num_attention_heads


def kv_elements_per_token_layer(arch: MoEArch, tp: int = 1) -> int:
    """Elements one rank caches per token and decoder layer at tensor parallelism `tp`."""
    if tp < 1:
        raise ValueError(f"tp: must be >= 1, got {tp}")
    if arch.attention == "mla":
        return arch.kv_lora_rank + arch.qk_pos_emb_head_dim
    return 2 * kv_groups_per_rank(arch, tp) * gqa_head_dim(arch)


def kv_bytes_per_token(arch: MoEArch, dtype: object = "bfloat16", tp: int = 1) -> int:
    """Bytes one rank caches per token of a sequence it serves: every decoder layer,
    at `dtype` (the cache's: the model's activation dtype by default).

    MLA: layers x (kv_lora_rank + qk_pos_emb_head_dim) x dtype bytes, at any `tp`.
    """
    return arch.num_layers * kv_elements_per_token_layer(arch, tp) * dtype_bytes(dtype)
