"""Batched KV-cache decoding on Megatron's static inference context (the CPU path).

The model runs through Megatron's own `GPTInferenceWrapper` and
`StaticInferenceContext` (the pieces `StaticInferenceEngine(legacy=True)` is built
from); the loop around them is ours because the engine has no per-request seeds,
per-request sampling settings or stop strings, and here it measured as fast.

Prompts of different lengths share one batch without padding inside the
sequence: every row sits at the same position `end`. The first forward reads
the shortest prompt's length for every row; after that one token a step, where a
row whose prompt is longer keeps reading its own prompt tokens until it reaches
its end. Positions are therefore the ones a plain forward would use, and the
result equals an uncached loop. Finished rows are moved to the back of the KV
cache and no longer fed (the cache reads rows `0..k-1` of whatever batch it is given).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.gpt import GPTModel

from moerl.rollout.routing_capture import RoutingCapture
from moerl.rollout.sampling import RowSampling, choose_tokens
from moerl.rollout.types import FinishReason, SpeculationStats

Detokenize = Callable[[list[int]], str]
# Every rank of a rollout server across ranks takes one rank's sampled tokens [k] and
# their logprobs [k] (`rollout.ranks`); a pipeline stage without logits gives None.
AgreeSamples = Callable[[torch.Tensor | None, torch.Tensor | None, int],
                        tuple[torch.Tensor, torch.Tensor]]


@dataclass
class DecodeRow:
    """One sequence to complete; filled in place by the decoder."""

    prompt: list[int]
    sampling: RowSampling
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    text: str = ""
    speculation: SpeculationStats | None = None  # filled by the speculative decoder
    routing: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The weight version that sampled each token."""
    """With a routing capture: (MoE layers, positions, top-k) of each forward that fed
    this row, in position order."""

    @property
    def max_tokens(self) -> int:
        return self.sampling.params.max_tokens


def check_stop(row: DecodeRow, eos_id: int | None, detokenize: Detokenize) -> None:
    """Set `row.finish_reason` (and the stop-cut text) after its newest token."""
    params = row.sampling.params
    token = row.token_ids[-1]
    if token in params.stop_token_ids or (token == eos_id and not params.ignore_eos):
        row.finish_reason = "stop"
    elif params.stop:
        text = detokenize(row.token_ids)
        hits = [i for i in (text.find(s) for s in params.stop) if i >= 0]
        if hits:
            row.finish_reason = "stop"
            row.text = text[: min(hits)]
            return
    if row.finish_reason is None and len(row.token_ids) >= row.max_tokens:
        row.finish_reason = "length"
    if row.finish_reason is not None:
        row.text = detokenize(row.token_ids)


class StaticDecoder:
    """Decodes a batch of `DecodeRow`s with a fresh KV cache sized to the batch."""

    def __init__(self, model: GPTModel, eos_id: int | None, detokenize: Detokenize,
                 agree: AgreeSamples | None = None,
                 capture: RoutingCapture | None = None) -> None:
        self.model = model
        self.eos_id = eos_id
        self.detokenize = detokenize
        self.device = next(model.parameters()).device
        self.agree = agree
        self.capture = capture
        self.version: Callable[[], int] = lambda: 0
        """The weights' version now (the engine's), recorded with every sampled token."""
        self.between_steps: Callable[[], None] | None = None
        """Partial rollouts: called after every decode step; a weight update it applies
        takes effect from the next token on (the KV cache so far is kept)."""

    def decode(self, rows: list[DecodeRow]) -> None:
        with torch.inference_mode(), InferenceMode.active():
            self._decode(rows)

    def _decode(self, rows: list[DecodeRow]) -> None:
        batch = len(rows)
        lengths = [len(r.prompt) for r in rows]
        tokens, context, wrapper, full = open_batch(self.model, rows, self.device)
        mask, positions = full["attention_mask"], full["position_ids"]

        live = list(range(batch))  # row index held by each KV-cache slot, unfinished rows first
        fed = batch  # slots 0..fed-1 are fed; the rest hold finished rows
        start, end = 0, min(lengths)
        while True:
            index = torch.tensor(live[:fed], device=self.device)
            window = {
                "tokens": tokens[index, start:end],  # [k, s]
                "position_ids": positions[index, start:end],  # [k, s]
                "attention_mask": None if mask is None else mask[..., start:end, :end],
            }
            # [k, V], for position `end`; None on a pipeline stage before the last
            logits = wrapper.run_one_forward_step(window)
            logits = None if logits is None else logits[:, -1, :]
            if self.capture is not None and self.capture.on:
                routed = self.capture.take(end - start, fed)
                for j, slot in enumerate(live[:fed]):
                    # A finished row waiting for compaction is fed its last token
                    # again: not a position of its own.
                    if rows[slot].finish_reason is None:
                        rows[slot].routing.append(routed[:, :, j])
            if start == 0:
                context.enable_decode_mode()
            self._advance(rows, live[:fed], lengths, logits, tokens, end)
            start, end = end, end + 1
            unfinished = [r for r in live[:fed] if rows[r].finish_reason is None]
            if not unfinished:
                return
            if self.between_steps is not None:
                self.between_steps()
            if fed - len(unfinished) >= max(1, fed // 4):
                compact_cache(context, live, unfinished)
                fed = len(unfinished)

    def _advance(
        self,
        rows: list[DecodeRow],
        slots: list[int],
        lengths: list[int],
        logits: torch.Tensor | None,
        tokens: torch.Tensor,
        end: int,
    ) -> None:
        """Sample position `end` for rows past their prompt that are still running.

        Rows still reading their prompt draw nothing, so a row's random stream never
        depends on the other prompts in the batch.
        """
        picks = [
            j for j, r in enumerate(slots) if end >= lengths[r] and rows[r].finish_reason is None
        ]
        if not picks:
            return
        chosen = [rows[slots[j]] for j in picks]
        new = logprobs = None
        if logits is not None:
            new, logprobs = choose_tokens(logits[picks], [row.sampling for row in chosen])
        if self.agree is not None:
            new, logprobs = self.agree(new, logprobs, len(picks))
        assert new is not None and logprobs is not None, "logits on one stage: no agreement"
        version = self.version()
        for j, row, token, logprob in zip(picks, chosen, new.tolist(), logprobs.tolist(),
                                          strict=True):
            tokens[slots[j], end] = token
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            row.versions.append(version)
            check_stop(row, self.eos_id, self.detokenize)


def open_batch(
    model: GPTModel, rows: list[DecodeRow], device: torch.device, slack: int = 0
) -> tuple[torch.Tensor, StaticInferenceContext, GPTInferenceWrapper, dict[str, Any]]:
    """The token buffer [B, T] (prompts written in), a fresh KV cache for the batch,
    its wrapper (model in eval mode) and the full-length inputs (mask [1, 1, T, T] or
    None, positions [B, T]). `slack` extra positions let a step look past the longest
    completion (speculative decoding feeds drafts there)."""
    lengths = [len(r.prompt) for r in rows]
    total = max(n + r.max_tokens for n, r in zip(lengths, rows, strict=True)) + slack
    tokens = torch.zeros(len(rows), total, dtype=torch.long, device=device)  # [B, T]
    for i, row in enumerate(rows):
        tokens[i, : lengths[i]] = torch.tensor(row.prompt, dtype=torch.long)
    context = new_cache(len(rows), total)
    wrapper = GPTInferenceWrapper(model, context)
    wrapper.prep_model_for_inference()  # eval mode, context reset to prefill
    return tokens, context, wrapper, wrapper.prep_inference_input(tokens)


def new_cache(rows: int, positions: int) -> StaticInferenceContext:
    """The KV cache of one batch: Megatron's static context, whose buffers each attention
    layer allocates on the batch's first forward, (positions, rows, heads/tp, dim) for
    its keys and for its values (`rollout.kv_layout` says what that comes to)."""
    return StaticInferenceContext(rows, positions)


def allocate_kv_cache(model: GPTModel, rows: int, positions: int) -> StaticInferenceContext:
    """The cache a batch of `rows` rows of up to `positions` tokens holds on this rank,
    allocated by each attention layer itself: one token through each layer's input
    norm and attention (the rest of the model allocates no cache). `model` in eval mode."""
    context = new_cache(rows, positions)
    config = model.config
    device = next(model.parameters()).device
    with torch.inference_mode(), InferenceMode.active():
        hidden = torch.zeros(1, rows, config.hidden_size, dtype=config.params_dtype,
                             device=device)  # [s=1, b, h]
        for layer in model.decoder.layers:
            layer.self_attention(layer.input_layernorm(hidden), attention_mask=None,
                                 inference_context=context)
    return context


def cache_bytes(context: StaticInferenceContext) -> int:
    """Bytes of the keys and values `context` holds."""
    return sum(t.numel() * t.element_size() for pair in context.key_value_memory_dict.values()
               for t in pair)


def compact_cache(context: StaticInferenceContext, live: list[int], unfinished: list[int]) -> None:
    """Reorder the KV cache so the unfinished rows take its first slots."""
    keep = set(unfinished)
    order = [s for s, r in enumerate(live) if r in keep]
    order += [s for s, r in enumerate(live) if r not in keep]
    context.swap_key_value_dict(torch.tensor(order))
    live[:] = [live[s] for s in order]
