"""Multi-latent attention over a latent KV cache, the up-projections absorbed.

The layer's own modules make the down-projections, the latent norms and the query's
up-projection; from there the cache holds, per token, the kv latent after its norm
c [kv_lora_rank] and the rotated key k_r [rope] (shared by every head), and never a
per-head key or value:

    score(q, k) = q_nope . (W_UK c) + q_r . k_r = (W_UK^T q_nope) . c + q_r . k_r
    out_h       = W_UV (sum_k p_k c_k)

W_UK [heads, qk_head_dim, kv_lora_rank] and W_UV [heads, v_head_dim, kv_lora_rank] are
views of `linear_kv_up_proj.weight` (Megatron lays its rows out per head as [key | value],
`MLASelfAttention.prepare_for_absorption`), read at every forward, so a weight update
needs no refresh. Under tensor parallelism a rank holds its heads' rows of W_UK / W_UV and
the whole latent; `linear_proj` (row-parallel) sums the heads over ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from moerl.rollout.lean_modules import linear, norm
from moerl.rollout.paged_attention import latent_attention
from moerl.rollout.rope_table import RopeTable
from moerl.rollout.step_plan import StepPlan


def _fused_norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    """The RMSNorm a Transformer Engine layernorm-linear holds, applied alone."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), module.layer_norm_weight, module.eps)


class MLAServing:
    """One layer's `MLASelfAttention`, served from the latent cache."""

    def __init__(self, attention: Any, rope: RopeTable) -> None:
        config = attention.config
        self.attention = attention
        self.rope = rope
        self.heads = attention.num_attention_heads_per_partition
        self.nope, self.rot = config.qk_head_dim, config.qk_pos_emb_head_dim
        self.value, self.rank = config.v_head_dim, config.kv_lora_rank
        self.scale = attention.softmax_scale
        self.q_lora = config.q_lora_rank is not None
        up = attention.linear_kv_up_proj
        # Transformer Engine fuses the kv latent norm into the up-projection.
        self.fused_kv_norm = hasattr(up, "layer_norm_weight")
        if self.fused_kv_norm and getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError("the continuous engine's MLA takes RMSNorm latent norms; "
                             "serve with --backend static or dynamic")

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, qk_head_dim, rank] and W_UV [heads, v_head_dim, rank], views."""
        weight = self.attention.linear_kv_up_proj.weight
        per_head = weight.view(self.heads, self.nope + self.value, self.rank)
        return per_head[:, : self.nope], per_head[:, self.nope:]

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, 1, H] -> query input [T, 1, q_lora or H], kv latent [T, rank] (normed) and
        rotary key [T, 1, rope] (not yet rotated)."""
        attention = self.attention
        q_compressed = x
        if self.q_lora:  # as `MLASelfAttention._qkv_down_projection`, without SP
            q_compressed = linear(attention.linear_q_down_proj, x)
            if q_compressed.size(-1) != attention.config.q_lora_rank:
                q_compressed = gather_from_tensor_model_parallel_region(
                    q_compressed, group=attention.tp_group)
        kv = linear(attention.linear_kv_down_proj, x)
        if kv.size(-1) != self.rank + self.rot:  # a column-parallel down-projection's share
            kv = gather_from_tensor_model_parallel_region(kv, group=attention.tp_group)
        kv_latent, k_rot = torch.split(kv, [self.rank, self.rot], dim=-1)
        if self.fused_kv_norm:
            kv_latent = _fused_norm(attention.linear_kv_up_proj, kv_latent)
        else:
            kv_latent = norm(attention.kv_layernorm, kv_latent)
        return q_compressed, kv_latent.reshape(-1, self.rank), k_rot.reshape(-1, 1, self.rot)

    def __call__(self, x: torch.Tensor, plan: StepPlan, latents: torch.Tensor) -> torch.Tensor:
        """x [T, 1, H] (normed) -> attention output [T, 1, H]; writes the step's cache rows."""
        tokens = x.shape[0]
        q_compressed, kv_latent, k_rot = self.latent(x)
        if self.q_lora:
            q = linear(self.attention.linear_q_up_proj,
                       norm(self.attention.q_layernorm, q_compressed))
        else:
            q = linear(self.attention.linear_q_proj, q_compressed)
        q = q.view(tokens, self.heads, self.nope + self.rot)
        q_nope, q_rot = torch.split(q, [self.nope, self.rot], dim=-1)
        # One rotation for the query's rotary part and the key: [T, heads + 1, rope]
        rotated = self.rope.rotate(torch.cat([q_rot, k_rot], dim=1))
        q_rot, k_rot = rotated[:, : self.heads], rotated[:, self.heads]
        latents.index_copy_(0, plan.write_slots, torch.cat([kv_latent, k_rot], -1)
                            .to(latents.dtype))
        up_k, up_v = self.absorbed()
        q_latent = torch.matmul(q_nope.transpose(0, 1), up_k).transpose(0, 1)  # [T, h, rank]
        query = torch.cat([q_latent, q_rot], dim=-1) * self.scale
        out = latent_attention(query.to(latents.dtype), latents, plan, self.rank)  # [T, h, rank]
        # [h, T, rank] x [h, rank, v] -> [T, h, v]
        out = torch.matmul(out.to(up_v.dtype).transpose(0, 1), up_v.transpose(1, 2))
        return linear(self.attention.linear_proj, out.transpose(0, 1).reshape(tokens, 1, -1))
