"""Attention of a step's queries over the paged cache, one batched matmul pair per bucket.

Keys are gathered from the cache by whole blocks ([B, Kmax / block_size] block ids,
`step_plan.Bucket`; the cache viewed as [blocks, block_size, ...]);
scores get the bucket's additive mask and a float32 softmax. Each bucket's outputs are
put back in token order (the plan lays tokens out bucket after bucket).

- `latent_attention`: MLA with the up-projections absorbed. Every head reads the same
  cached row [latent | rotary key] (C = kv_lora_rank + rope), so a bucket is one
  [B, Qmax*heads, C] x [B, C, Kmax] product, and the values are the first
  kv_lora_rank columns of the same rows.
- `grouped_attention`: GQA over cached per-group keys and values.

A prefill bucket's queries run in slices when its scores would pass `_SCORES_LIMIT`
elements, so a long prompt costs its attention's time, not B x Qmax x heads x Kmax floats.
"""

from __future__ import annotations

import torch

from moerl.rollout.step_plan import Bucket, StepPlan

# Scores held at once per bucket (elements): a bucket's queries run in slices under it.
_SCORES_LIMIT = 2**25


def _queries(query: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """[B, Qmax, heads, d] of `query` [T, heads, d]."""
    if bucket.query_index is None:
        return query[bucket.tokens].unsqueeze(1)
    return query[bucket.query_index]


def _in_token_order(out: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """[B * Qmax, heads, d] -> the bucket's real tokens [n, heads, d]."""
    return out if bucket.valid is None else out.index_select(0, bucket.valid)


def _softmax(scores: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.softmax(scores.float() + mask, dim=-1).to(dtype)


def _gather(cache: torch.Tensor, bucket: Bucket, block_size: int) -> torch.Tensor:
    """cache [slots, ...] -> the bucket's keys [B, Kmax, ...]."""
    batch, blocks = bucket.key_blocks.shape
    by_block = cache.view(-1, block_size, *cache.shape[1:])
    return by_block.index_select(0, bucket.key_blocks.reshape(-1)).view(
        batch, blocks * block_size, *cache.shape[1:])


def _query_slices(batch: int, q_max: int, heads: int, k_max: int) -> list[slice]:
    """Runs of query positions whose scores [B, run, heads, Kmax] stay under
    `_SCORES_LIMIT` elements (a long prompt's chunk would otherwise hold them all)."""
    run = max(1, _SCORES_LIMIT // max(1, batch * heads * k_max))
    return [slice(start, min(start + run, q_max)) for start in range(0, q_max, run)]


def latent_attention(query: torch.Tensor, latents: torch.Tensor, plan: StepPlan,
                     value_width: int) -> torch.Tensor:
    """query [T, heads, C] (scale folded in), latents [slots, C] -> [T, heads, value_width]."""
    heads, width = query.shape[1], query.shape[2]
    outs = []
    for bucket in plan.buckets:
        keys = _gather(latents, bucket, plan.block_size)  # [B, Kmax, C]
        batch, k_max = keys.shape[0], keys.shape[1]
        q = _queries(query, bucket)  # [B, Qmax, heads, C]
        parts = []
        for run in _query_slices(batch, q.shape[1], heads, k_max):
            q_run = q[:, run]  # [B, r, heads, C]
            length = q_run.shape[1]
            scores = torch.bmm(q_run.reshape(batch, length * heads, width), keys.transpose(1, 2))
            scores = scores.view(batch, length, heads, k_max)
            probs = _softmax(scores, bucket.mask[:, run, None, :], keys.dtype)
            parts.append(torch.bmm(probs.view(batch, length * heads, k_max),
                                   keys[..., :value_width]).view(batch, length, heads, -1))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [B, Qmax, h, v]
        outs.append(_in_token_order(out.reshape(-1, heads, value_width), bucket))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      plan: StepPlan) -> torch.Tensor:
    """query [T, heads, d] (scale folded in), keys / values [slots, groups, d] -> [T, heads, d].

    Query head h reads group h // (heads / groups), as Megatron lays heads out."""
    heads, dim = query.shape[1], query.shape[2]
    groups = keys.shape[1]
    per_group = heads // groups
    outs = []
    for bucket in plan.buckets:
        k = _gather(keys, bucket, plan.block_size).permute(0, 2, 3, 1)  # [B, G, d, Kmax]
        v = _gather(values, bucket, plan.block_size).transpose(1, 2)  # [B, G, Kmax, d]
        batch, k_max = k.shape[0], k.shape[3]
        q = _queries(query, bucket)  # [B, Qmax, heads, d]
        parts = []
        for run in _query_slices(batch, q.shape[1], heads, k_max):
            length = q[:, run].shape[1]
            # [B, r, heads, d] -> [B, G, r * hpg, d]
            q_run = q[:, run].reshape(batch, length, groups, per_group, dim).transpose(1, 2)
            scores = torch.matmul(q_run.reshape(batch, groups, length * per_group, dim), k)
            scores = scores.view(batch, groups, length, per_group, k_max)
            probs = _softmax(scores, bucket.mask[:, None, run, None, :], v.dtype)
            out = torch.matmul(probs.view(batch, groups, length * per_group, k_max), v)
            parts.append(out.view(batch, groups, length, per_group, dim).transpose(1, 2))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [B, Qmax, G, hpg, d]
        outs.append(_in_token_order(out.reshape(-1, heads, dim), bucket))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
