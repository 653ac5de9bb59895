"""Grouped-query attention over a paged per-group key/value cache.

The layer's own `get_query_key_value_tensors` makes q [T, 1, heads, d] and k, v
[T, 1, groups, d] (its q/k norms included, its tensor-parallel share of heads); the
rotary embedding is the model's, at each token's position; `linear_proj` sums heads
over tensor-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from moerl.rollout.lean_modules import linear
from moerl.rollout.paged_attention import grouped_attention
from moerl.rollout.rope_table import RopeTable
from moerl.rollout.step_plan import StepPlan


class GQAServing:
    """One layer's `SelfAttention`, served from the paged cache."""

    def __init__(self, attention: Any, rope: RopeTable) -> None:
        self.attention = attention
        self.rope = rope
        self.scale = attention.core_attention.softmax_scale

    def __call__(self, x: torch.Tensor, plan: StepPlan,
                 cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, 1, H] (normed) -> attention output [T, 1, H]; writes the step's keys/values."""
        keys, values = cache
        tokens = x.shape[0]
        q, k, v = self.attention.get_query_key_value_tensors(x, None)[:3]
        heads = q.shape[-2]
        # One rotation for queries and keys: [T, heads + groups, d]
        rotated = self.rope.rotate(torch.cat([q.reshape(tokens, heads, -1),
                                              k.reshape(tokens, k.shape[-2], -1)], dim=1))
        q, k = rotated[:, :heads], rotated[:, heads:]
        keys.index_copy_(0, plan.write_slots, k.to(keys.dtype))
        values.index_copy_(0, plan.write_slots, v.reshape(k.shape).to(values.dtype))
        out = grouped_attention((q * self.scale).to(keys.dtype), keys, values, plan)
        return linear(self.attention.linear_proj, out.to(x.dtype).reshape(tokens, 1, -1))
