"""What the moerl engine's KV cache holds per token: the planner's number, the engine's word.

The static decoder (`rollout.static_decode`) opens Megatron's `StaticInferenceContext`
for a batch, and every attention layer allocates its own cache on the first forward
(`Attention._adjust_key_value_for_inference`): key and value after the up-projection,
(positions, rows, heads / tp, dim) each, in the activation dtype. For multi-latent
attention that is the full per-head key (qk_head_dim + qk_pos_emb_head_dim) and value
(v_head_dim), not the compressed latent (kv_lora_rank + qk_pos_emb_head_dim) that
MLA's absorbed decoding would cache: Kimi-K2 (64 heads, 61 layers) caches 2.5 MB a
token at TP1, 36 times its 69 KB latent. GQA caches its query groups' keys and values.

Every rank of a server runs the same batch (`rollout.ranks`): a tensor-parallel rank
holds its heads of every row, and the attention data-parallel replicas beside it
hold the same rows again, so a rank's cache is rows x positions x layers x this.

`moerl plan` sizes engines with it; `moerl rehearse` runs the engine's allocation
on tensors that hold no memory and refuses a plan whose bytes differ, so a change
to what the engine caches must change this module too. No torch here: the planner
imports it.
"""

from __future__ import annotations

from moerl.models.arch import MoEArch

CACHE_BYTES = 2  # bf16: the activations the serving model computes in (also with FP8 GEMMs)


def kv_bytes_per_token_layer(arch: MoEArch, tp: int) -> float:
    """Bytes one rank caches per token and decoder layer at tensor parallelism `tp`."""
    heads = arch.num_attention_heads
    if arch.attention == "mla":
        key = arch.qk_head_dim + arch.qk_pos_emb_head_dim
        return heads / tp * (key + arch.v_head_dim) * CACHE_BYTES
    groups = arch.num_query_groups or heads
    kv_channels = arch.kv_channels or arch.hidden_size // heads
    return 2 * groups / tp * kv_channels * CACHE_BYTES
