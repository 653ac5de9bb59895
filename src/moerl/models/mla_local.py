"""Two fixes that make multi-latent attention exact with Megatron-Core's local spec.

The local (non-Transformer-Engine) spec is what runs on CPU. Both classes are drop-in
replacements inside the MLA layer spec; the TE spec does not need them.

Packed rows: Megatron's MLA treats any `PackedSeqParams` as THD (one flattened row,
TE's layout). Rows of [s, b] with document boundaries (qkv_format="sbhd", what the
ring attention of `models.ring_attention` takes) instead go around MLA's own code
straight to the core attention (`TPExactMLASelfAttention.forward`).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


class MLADotProductAttention(DotProductAttention):
    """`DotProductAttention` that accepts MLA's head sizes.

    MLA builds its core attention with `k_channels` (qk_head_dim + rope dim) and
    `v_channels` (v_head_dim), which the local class rejects. Queries and keys
    carry their own size through the matmul; only the output view needs the value
    size: context [sq, b, np, v_head_dim] -> [sq, b, np * v_head_dim].
    """

    def __init__(
        self,
        *args: Any,
        k_channels: int | None = None,
        v_channels: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


class TPExactMLASelfAttention(MLASelfAttention):
    """MLA whose shared RoPE key gets its full gradient at TP > 1 (local spec).

    Upstream bug (Megatron-LM issue #1699): with the local spec `linear_kv_down_proj`
    is a ColumnParallelLinear, so its output [s, b, (kv_lora_rank + rope) / TP] is
    gathered with `gather_from_tensor_model_parallel_region`, whose backward keeps
    only this rank's slice of the gradient. `k_pos_emb` [s, b, rope] is shared by
    every head, and each TP rank holds only some heads: the other ranks' share of
    its gradient is dropped (about half of it at TP=2). Adam magnifies that into a
    loss drift within a few steps.

    Here the gather happens before Megatron's own code sees the tensor, and the
    RoPE part goes through `copy_to_tensor_model_parallel_region` (identity
    forward, all-reduce backward), which restores the sum over ranks. The result
    has the full width, so Megatron takes its "replicated down projection" branch:
    with sequence parallelism that branch expects [s / TP, b, full] and all-gathers
    `k_pos_emb` itself (reduce-scatter in backward: again the sum over ranks), so
    there the tensor is scattered back instead of all-reduced.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        packed = kwargs.get("packed_seq_params")
        if packed is None or packed.qkv_format != "sbhd":
            return super().forward(*args, **kwargs)
        core = self.core_attention
        if not hasattr(core, "documents"):
            raise ValueError(
                "packed [s, b] rows with MLA on the local spec need the ring attention "
                "(parallel.cp > 1) or Transformer Engine (THD packing)")
        kwargs["packed_seq_params"] = None  # plain [s, b] rows for MLA's projections
        core.documents = packed
        try:
            return super().forward(*args, **kwargs)
        finally:
            core.documents = None

    def _qkv_down_projection(self, hidden_states: torch.Tensor) -> Any:
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        full = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        if kv_combined.size(-1) == full:
            return q_compressed, kv_combined
        # [s, b, full / TP] -> [s, b, full]
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=self.tp_group)
        if self.config.sequence_parallel:
            # [s, b, full] -> [s / TP, b, full]; Megatron re-gathers k_pos_emb.
            return q_compressed, scatter_to_sequence_parallel_region(
                kv_combined, group=self.tp_group
            )
        kv_compressed, k_pos_emb = torch.split(
            kv_combined, [self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim], dim=-1
        )
        k_pos_emb = copy_to_tensor_model_parallel_region(k_pos_emb, group=self.tp_group)
        return q_compressed, torch.cat([kv_compressed, k_pos_emb], dim=-1)
