"""Rewarded samples and their packing into same-shape micro-batches for the policy update.

A sample is a prompt and a completion of token ids. The model reads the whole sequence
s = prompt + completion (length L = P + C) shifted by one:

    tokens[t] = s[t],  labels[t] = s[t + 1],  t = 0 .. L - 2

so the logprob at position t is that of token t + 1, and completion token j (index P + j
in s) sits at position P - 1 + j. The loss mask is 1 there (and only there; a per-token
mask can switch off environment tokens of a multi-turn completion), and the rollout
logprobs and per-token advantages are placed at the same positions.

Shapes. Every micro-batch of one update has the same (B, T): T is the longest sequence
of the global batch (L - 1 tokens) rounded up to `pad_multiple` (the TP size, which
sequence parallelism needs), and B = token_budget // T rows, one sample per row, padded
with empty rows (mask 0) where a rank has run out of samples. The pipeline schedule then
sends fixed-shape activations and every data-parallel rank runs the same number of
micro-batches (expert-parallel all-to-alls span data-parallel ranks, so they must).
Megatron's `variable_seq_lengths` would avoid the padding at the price of a shape
exchange per micro-batch; rows are not concatenated (THD packing needs TE attention).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORED_TOKEN = 0  # token id used for padding; its positions carry no loss


@dataclass(frozen=True)
class RLSample:
    """One rewarded completion. Per-token tensors are over the C completion tokens."""

    prompt_ids: torch.Tensor  # (P,) int64, P >= 1
    completion_ids: torch.Tensor  # (C,) int64, C >= 1
    advantage: float | torch.Tensor  # scalar, or (C,) per completion token
    rollout_logprobs: torch.Tensor | None = None  # (C,) logprobs the engine reported
    loss_mask: torch.Tensor | None = None  # (C,) 1 = trained on; None = all completion tokens
    reward: float = 0.0
    weight_version: int = 0  # policy version the engine sampled with (staleness)
    token_versions: torch.Tensor | None = None
    """(C,) int64: the version that sampled each completion token, when a weight update
    landed during its generation (partial rollouts); None: all `weight_version`."""
    group_id: int = 0  # samples of the same prompt share it
    routed_experts: torch.Tensor | None = None
    """(num MoE layers, P + C, topk) expert ids the engine chose per token; for replay."""

    def __post_init__(self) -> None:
        c = self.completion_ids.numel()
        if self.prompt_ids.dim() != 1 or self.prompt_ids.numel() < 1:
            raise ValueError("prompt_ids must be a non-empty 1-d tensor of token ids")
        if self.completion_ids.dim() != 1 or c < 1:
            raise ValueError("completion_ids must be a non-empty 1-d tensor of token ids")
        for name in ("rollout_logprobs", "loss_mask", "token_versions"):
            t = getattr(self, name)
            if t is not None and t.shape != (c,):
                raise ValueError(f"{name} must have shape ({c},), got {tuple(t.shape)}")
        if isinstance(self.advantage, torch.Tensor) and self.advantage.shape not in ((), (c,)):
            raise ValueError(f"advantage must be a scalar or ({c},), got {self.advantage.shape}")
        r = self.routed_experts
        if r is not None and (r.dim() != 3 or r.shape[1] != len(self)):
            raise ValueError(f"routed_experts must be (layers, {len(self)}, topk), got {r.shape}")

    def __len__(self) -> int:
        return self.prompt_ids.numel() + self.completion_ids.numel()

    @property
    def per_token_advantage(self) -> bool:
        return isinstance(self.advantage, torch.Tensor) and self.advantage.dim() == 1


@dataclass(frozen=True)
class RLMicroBatch:
    """B rows of T positions; every (B, T) tensor is aligned to the labels."""

    tokens: torch.Tensor  # (B, T) int64 inputs
    labels: torch.Tensor  # (B, T) int64, labels[:, t] = tokens[:, t + 1] of the sequence
    position_ids: torch.Tensor  # (B, T) int64
    loss_mask: torch.Tensor  # (B, T) float32, 1 on completion tokens that carry loss
    valid: torch.Tensor  # (B, T) bool, real (non-padding) input tokens
    advantages: torch.Tensor  # (B,) per sequence, or (B, T) per token
    rollout_logprobs: torch.Tensor | None  # (B, T), 0 off the completion
    routed_experts: torch.Tensor | None  # (layers, B, T, topk) int64 for the input tokens
    sample_index: list[int]  # global index of each real row's sample (len <= B)
    token_versions: torch.Tensor | None = None
    """(B, T) int64: the weight version that sampled each completion token (a partial
    rollout's tokens may come from two), -1 elsewhere."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.tokens.shape[0], self.tokens.shape[1])


@dataclass(frozen=True)
class PackPlan:
    """The common micro-batch shape of one update and how the samples are split."""

    rows: int  # B
    seq_length: int  # T
    num_microbatches: int  # per data-parallel rank
    per_rank: int  # samples per data-parallel rank (the last rank may hold fewer)


def plan_microbatches(
    samples: Sequence[RLSample], token_budget: int, dp_size: int = 1, pad_multiple: int = 1
) -> PackPlan:
    """Shape of the micro-batches: T from the longest sample, B = token_budget // T."""
    if not samples:
        raise ValueError("no samples to pack")
    longest = max(len(s) for s in samples) - 1
    seq_length = math.ceil(longest / pad_multiple) * pad_multiple
    if seq_length > token_budget:
        raise ValueError(
            f"token_budget {token_budget} is smaller than the longest sequence "
            f"({seq_length} tokens after padding); raise it"
        )
    rows = token_budget // seq_length
    per_rank = math.ceil(len(samples) / dp_size)
    return PackPlan(rows, seq_length, math.ceil(per_rank / rows), per_rank)


def rank_samples(samples: Sequence[RLSample], plan: PackPlan, dp_rank: int) -> range:
    """Global indices of the contiguous block of samples data-parallel rank `dp_rank` takes."""
    start = min(dp_rank * plan.per_rank, len(samples))
    return range(start, min(start + plan.per_rank, len(samples)))


def pack(
    samples: Sequence[RLSample], plan: PackPlan, dp_rank: int = 0
) -> list[RLMicroBatch]:
    """This rank's `plan.num_microbatches` micro-batches, all of shape (B, T)."""
    mine = list(rank_samples(samples, plan, dp_rank))
    per_token = any(s.per_token_advantage for s in samples)
    with_rollout = all(s.rollout_logprobs is not None for s in samples)
    with_routing = all(s.routed_experts is not None for s in samples)
    out = []
    for k in range(plan.num_microbatches):
        rows = mine[k * plan.rows : (k + 1) * plan.rows]
        out.append(
            _pack_rows(samples, rows, plan, per_token=per_token,
                       with_rollout=with_rollout, with_routing=with_routing)
        )
    return out


def _pack_rows(
    samples: Sequence[RLSample],
    rows: list[int],
    plan: PackPlan,
    *,
    per_token: bool,
    with_rollout: bool,
    with_routing: bool,
) -> RLMicroBatch:
    b, t = plan.rows, plan.seq_length
    tokens = torch.full((b, t), IGNORED_TOKEN, dtype=torch.int64)
    labels = torch.full((b, t), IGNORED_TOKEN, dtype=torch.int64)
    mask = torch.zeros(b, t)
    valid = torch.zeros(b, t, dtype=torch.bool)
    adv = torch.zeros(b, t) if per_token else torch.zeros(b)
    rollout = torch.zeros(b, t) if with_rollout else None
    versions = torch.full((b, t), -1, dtype=torch.int64)
    routing = None
    if with_routing:
        layers, _, topk = samples[0].routed_experts.shape  # type: ignore[union-attr]
        # Padding tokens are routed too: give them k distinct experts.
        routing = torch.arange(topk).expand(layers, b, t, topk).clone()
    for row, index in enumerate(rows):
        s = samples[index]
        seq = torch.cat([s.prompt_ids, s.completion_ids]).long()  # (L,)
        n, p, c = len(s) - 1, s.prompt_ids.numel(), s.completion_ids.numel()
        tokens[row, :n], labels[row, :n] = seq[:-1], seq[1:]
        valid[row, :n] = True
        done = slice(p - 1, p - 1 + c)  # positions whose label is a completion token
        mask[row, done] = 1.0 if s.loss_mask is None else s.loss_mask.float()
        if per_token:
            adv[row, done] = torch.as_tensor(s.advantage, dtype=torch.float32)
        else:
            adv[row] = float(s.advantage)
        if rollout is not None:
            rollout[row, done] = s.rollout_logprobs.float()  # type: ignore[union-attr]
        versions[row, done] = s.weight_version if s.token_versions is None else s.token_versions
        if routing is not None:
            routing[:, row, :n] = s.routed_experts[:, :n].long()  # type: ignore[index]
    positions = torch.arange(t, dtype=torch.int64).expand(b, t).contiguous()
    return RLMicroBatch(tokens, labels, positions, mask, valid, adv, rollout, routing, rows,
                        versions)
