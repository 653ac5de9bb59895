"""Choosing the next token for a batch of rows that each have their own sampling settings.

Temperature, top-k and top-p are applied to the whole batch at once (the sorted logits
of the rows that truncate, the logits as they are for the others); only the one
uniform number a row needs is drawn per row, from that row's own `torch.Generator`. A
row's choice therefore depends only on its own logits and seed, not on which other
requests share the batch (inverse-CDF sampling: a tiny numerical change in the logits
flips a choice only when the uniform number falls within that change of a bucket edge).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.rollout.types import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, sample) pairs apart


def sample_seed(seed: int, sample_index: int) -> int:
    """The generator seed of sample `sample_index` of a request seeded with `seed`."""
    return (seed * 1_000_003 + sample_index * _SEED_MIX) % (2**63)


@dataclass
class RowSampling:
    """One row of a decoding batch: the request's settings and this sample's generator."""

    params: SamplingParams
    generator: torch.Generator

    @classmethod
    def make(cls, params: SamplingParams, seed: int, sample_index: int) -> RowSampling:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(sample_seed(seed, sample_index))
        return cls(params, generator)


def _settings(
    rows: list[RowSampling], vocab: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Per-row [B] tensors: sampling temperature, top-k (0 -> vocab), top-p,
    logprob temperature, greedy flag."""
    temp = [r.params.temperature or 1.0 for r in rows]
    top_k = [r.params.top_k or vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    lp_temp = [
        (r.params.temperature or 1.0) if r.params.logprob_mode == "sampling" else 1.0 for r in rows
    ]
    greedy = [r.params.temperature == 0 for r in rows]
    f32 = torch.float32
    return (
        torch.tensor(temp, dtype=f32, device=device),
        torch.tensor(top_k, dtype=torch.long, device=device),
        torch.tensor(top_p, dtype=f32, device=device),
        torch.tensor(lp_temp, dtype=f32, device=device),
        torch.tensor(greedy, dtype=torch.bool, device=device),
    )


def choose_tokens(
    logits: torch.Tensor, rows: list[RowSampling]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its logprob for every row.

    logits: [B, V] (any float dtype) -> (tokens [B] long, logprobs [B] float32).

    Greedy rows take the argmax (the lowest id on ties). A row with top-k or top-p
    draws by inverse CDF over its sorted, truncated distribution; a row without either
    over its distribution in vocabulary order (the same law, without a sort over the
    vocabulary). Each row uses one uniform number from its own generator.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    temp, top_k, top_p, lp_temp, greedy = _settings(rows, vocab, logits.device)
    uniform = torch.stack([torch.rand((), generator=r.generator) for r in rows]).to(
        logits.device)  # [B]
    truncated = [r.params.temperature != 0 and (0 < r.params.top_k < vocab
                                                 or r.params.top_p < 1) for r in rows]
    probs = torch.softmax(logits / temp[:, None], dim=-1)  # [B, V]
    cdf = probs.cumsum(-1)  # [B, V]
    tokens = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
    tokens = tokens.clamp_(max=vocab - 1).squeeze(1)  # [B]
    if any(truncated):
        rows_t = torch.tensor([i for i, t in enumerate(truncated) if t], device=logits.device)
        tokens[rows_t] = _truncated(logits[rows_t], temp[rows_t], top_k[rows_t],
                                    top_p[rows_t], uniform[rows_t])
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.argmax(-1), tokens)
    logprobs = torch.log_softmax(logits / lp_temp[:, None], dim=-1)  # [B, V]
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _truncated(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws [k] over each row's top-k / top-p prefix of its sorted
    distribution (logits [k, V])."""
    vocab = logits.shape[-1]
    # Sorted once; ties keep the lower id first.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [k, V] each
    probs = torch.softmax(sorted_logits / temp[:, None], dim=-1)  # [k, V]
    rank = torch.arange(vocab, device=logits.device)
    keep = rank[None, :] < top_k[:, None]
    # Top-p keeps the smallest prefix whose mass reaches p (the first token always).
    keep &= (probs.cumsum(-1) - probs) < top_p[:, None]
    cdf = (probs * keep).cumsum(-1)  # [k, V], non-decreasing
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)  # [k, 1]
    # Both filters keep a prefix of the sorted ids; rounding of u * total must not step past it.
    picked = torch.minimum(picked, keep.sum(-1, keepdim=True) - 1)
    return order.gather(1, picked).squeeze(1)
