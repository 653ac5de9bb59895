"""Attention changes that `sft_sample_efficiency.py`'s diagnostic variants make to a
built moerl model, outside any shipped architecture:

- `scale_attention_logits`: every attention layer's softmax scale multiplied by a factor
  (the logits' size at initialisation, without changing what the weights can express);
- `head_qk_norms`: multi-latent attention with an RMSNorm (learned gain) on each head's
  query and key, after RoPE, the way Qwen3 normalises its heads; DeepSeek-V3 has
  norms on the latents only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

import moerl.models.build as build
from moerl.models.mla_local import TPExactMLASelfAttention


def scale_attention_logits(chunks: list[Any], factor: float) -> None:
    """Multiply the softmax scale of every attention layer in `chunks` by `factor`."""
    for chunk in chunks:
        for module in chunk.modules():
            if not hasattr(module, "core_attention"):
                continue
            if getattr(module, "softmax_scale", None) is not None:  # MLA keeps its own
                module.softmax_scale *= factor
            module.core_attention.softmax_scale *= factor


class HeadNormMLA(TPExactMLASelfAttention):
    """MLA whose queries and keys [s, b, heads, q_head_dim] are RMS-normalised per head."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.q_head_gain = torch.nn.Parameter(torch.ones(self.q_head_dim))
        self.k_head_gain = torch.nn.Parameter(torch.ones(self.q_head_dim))

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any) -> Any:
        query, key, *rest = super().get_query_key_value_tensors(*args, **kwargs)
        eps, width = self.config.layernorm_epsilon, (self.q_head_dim,)
        return (F.rms_norm(query, width, self.q_head_gain, eps),
                F.rms_norm(key, width, self.k_head_gain, eps), *rest)


@contextmanager
def head_qk_norms() -> Iterator[None]:
    """MLA layers built inside this block are `HeadNormMLA`."""
    local = build.TPExactMLASelfAttention
    build.TPExactMLASelfAttention = HeadNormMLA
    try:
        yield
    finally:
        build.TPExactMLASelfAttention = local
