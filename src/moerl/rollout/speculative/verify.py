"""Scoring drafts with the policy in one cached forward step, and the acceptance rule.

The rule (Leviathan et al. 2023; Chen et al. 2023). With p the policy's sampling
distribution at a position (after temperature, top-k, top-p) and q the drafter's:
accept draft x with probability min(1, p(x) / q(x)); on the first rejection draw the
position's token from the residual max(0, p - q) / sum(max(0, p - q)) and stop; if
every draft is accepted, draw one more (bonus) token from p at the next position.
Each emitted token then has exactly distribution p given the tokens before it. A
deterministic drafter's q is a point mass on x: accept with probability p(x), and on
rejection draw from p with x removed, renormalised. Greedy rows have a point-mass p
(the argmax, lowest id on ties, as `sampling.choose_tokens`), so a draft is kept
exactly when it equals the argmax and the correction is the argmax: the tokens of
non-speculative greedy decoding.

KV cache: Megatron's `StaticInferenceContext` writes the keys and values of a
window at positions [sequence_len_offset, sequence_len_offset + W) of every row and
attends to [0, sequence_len_offset + W); the offset is one integer shared by the
batch (and, for MLA, also selects the RoPE positions). Rolling back is therefore
setting the offset to the first position whose entry is not valid for some row;
the entries past it are zeroed so no draft's keys outlive its rejection (they would
be overwritten before being read anyway).
"""

from __future__ import annotations

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.models.gpt import GPTModel

from moerl.rollout.sampling import RowSampling, _settings


def policy_probs(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """The distribution `sampling.choose_tokens` draws from, in vocabulary order.

    logits: [N, V] -> probs [N, V] float32, each row summing to 1; greedy rows are a
    one-hot at the argmax. Same transform as `choose_tokens` (sorted logits,
    temperature, top-k, top-p keeping the smallest prefix reaching p).
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    temp, top_k, top_p, _, greedy = _settings(rows, vocab, logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [N, V]
    probs = torch.softmax(sorted_logits / temp[:, None], dim=-1)
    rank = torch.arange(vocab, device=logits.device)
    keep = rank[None, :] < top_k[:, None]
    keep &= (probs.cumsum(-1) - probs) < top_p[:, None]
    kept = probs * keep
    kept = kept / kept.sum(-1, keepdim=True)
    kept = torch.where(greedy[:, None], (rank[None, :] == 0).to(kept.dtype), kept)
    return torch.zeros_like(kept).scatter_(1, order, kept)  # back to vocabulary order


def token_logprobs(logits: torch.Tensor, rows: list[RowSampling],
                   tokens: torch.Tensor) -> torch.Tensor:
    """Logprob of `tokens` [N] under each row's logprob mode: [N, V] -> [N] float32
    (the same numbers `choose_tokens` returns for these tokens)."""
    _, _, _, lp_temp, _ = _settings(rows, logits.shape[-1], logits.device)
    logprobs = torch.log_softmax(logits.float() / lp_temp[:, None], dim=-1)
    return logprobs.gather(1, tokens[:, None]).squeeze(1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` [V] (unnormalised is fine) by inverse CDF, one uniform."""
    cdf = probs.cumsum(0)  # [V]
    target = torch.rand((), generator=generator).to(probs.device) * cdf[-1]
    picked = int(torch.searchsorted(cdf, target[None], right=True))
    # Rounding of u * total may step past the last token with mass: take that one.
    last = int(torch.nonzero(probs > 0)[-1])
    return min(picked, last)


def accept_drafts(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                  generator: torch.Generator) -> tuple[int, int]:
    """The speculative-sampling rule for one sequence.

    p: [D + 1, V] policy distributions at the D draft positions and the bonus one;
    q: [D, V] the drafter's distributions, or None for point masses on `drafts`.
    Returns (number of drafts accepted a, the token the policy adds at position a).
    """
    for i, token in enumerate(drafts):
        q_token = 1.0 if q is None else float(q[i, token])
        u = float(torch.rand((), generator=generator))
        if u * q_token < float(p[i, token]):  # u < p / q without dividing; q(x) > 0
            continue
        if q is None:
            residual = p[i].clone()
            residual[token] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)
        if not float(residual.sum()) > 0:  # p == q up to rounding: rejection had no mass
            residual = p[i]
        return i, draw(residual, generator)
    return len(drafts), draw(p[len(drafts)], generator)


def causal_window_mask(offset: int, width: int, device: torch.device) -> torch.Tensor:
    """[1, 1, W, offset + W] bool, True = masked: window query j (position offset + j)
    sees keys 0 .. offset + j. Megatron stops masking once the cache offset is past
    0, so a window of several tokens needs its mask given explicitly."""
    query = torch.arange(offset, offset + width, device=device)[:, None]
    key = torch.arange(offset + width, device=device)[None, :]
    return (key > query)[None, None]


class CachedPolicy:
    """The policy over one batch's static KV cache: run a window, roll back.

    `forward` returns logits for every window position (Megatron's static context
    keeps only the last by default) and, with `keep_hidden`, the decoder's output
    hidden states (what Megatron's MTP layer takes as input).
    """

    def __init__(self, model: GPTModel, context: StaticInferenceContext,
                 wrapper: GPTInferenceWrapper, keep_hidden: bool = False) -> None:
        self.context = context
        self.wrapper = wrapper
        context.config.materialize_only_last_token_logits = False
        self._hidden: torch.Tensor | None = None
        self._hook = None
        if keep_hidden:
            self._hook = model.decoder.register_forward_hook(self._capture)

    def _capture(self, module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        self._hidden = output  # [W, k, H]

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()

    @property
    def offset(self) -> int:
        return int(self.context.sequence_len_offset)

    def forward(self, window: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """window, positions: [k, W] for cache positions offset .. offset + W - 1 of the
        first k slots -> (logits [k, W, V] float32, hidden [W, k, H] or None)."""
        mask = causal_window_mask(self.offset, window.shape[1], window.device)
        logits = self.wrapper.run_one_forward_step(
            {"tokens": window, "position_ids": positions, "attention_mask": mask})
        self.context.enable_decode_mode()
        return logits.float(), self._hidden

    def rollback(self, offset: int) -> None:
        """Keep cache positions [0, offset); forget (and zero) the rest written so far."""
        end = self.offset
        assert 0 < offset <= end, (offset, end)
        for key, value in self.context.key_value_memory_dict.values():  # [T, B, ...] each
            key[offset:end] = 0
            value[offset:end] = 0
        self.context.sequence_len_offset = offset
