"""Speculative decoding on the static KV cache: drafts verified by the policy, exactly.

Built from `static_decode`'s pieces (batch set-up, stop checks, cache compaction).
Every step feeds one window of W positions [offset, offset + W) for the whole
batch, where `offset` is the KV cache's shared length. A row's window holds first
its *known* tokens not yet in the cache (prompt tokens still unread, or tokens it
emitted last step beyond the shared offset), then its drafts, then filler. From
the logits the rule of `speculative.verify` keeps a prefix of the drafts and adds
one policy token; the cache then keeps the longest prefix valid for every row (the
minimum over rows of known + accepted positions) and rolls back the rest. Rows
ahead of that minimum re-feed their extra known tokens next step, as rows with a
longer prompt do in `static_decode`: positions stay those of a plain forward and
no row ever holds a gap, which keeps the result equal to plain decoding.

A row's random stream (drafting and acceptance draws) is its own generator, so a
request is reproducible; unlike plain decoding, the number of drafts a row gets in
a step depends on the shared offset, so its sampled tokens (not their
distribution) may depend on which other requests share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.gpt import GPTModel

from moerl.rollout.sampling import RowSampling
from moerl.rollout.speculative.config import DraftLength, SpeculativeConfig
from moerl.rollout.speculative.drafters import Draft, DraftRequest, make_drafter
from moerl.rollout.speculative.verify import (
    CachedPolicy,
    accept_drafts,
    policy_probs,
    token_logprobs,
)
from moerl.rollout.static_decode import (
    DecodeRow,
    Detokenize,
    check_stop,
    compact_cache,
    open_batch,
)
from moerl.rollout.types import SpeculationStats


@dataclass
class _RowState:
    length: DraftLength
    known: int  # tokens of prompt + completion so far
    hidden: torch.Tensor | None = None  # [H] decoder output at position known - 2 (MTP input)
    drafted: int = 0
    accepted: int = 0
    steps: int = 0


@dataclass
class _Step:
    """One window: where it starts, how wide, the slots fed and each row's drafts."""

    offset: int
    width: int
    slots: list[int]  # row index held by each fed cache slot
    drafts: dict[int, Draft]  # row index -> its drafts (rows that draft this step)


class SpeculativeDecoder:
    """Decodes a batch of `DecodeRow`s with drafts from `config.mode`'s drafter."""

    def __init__(self, model: GPTModel, eos_id: int | None, detokenize: Detokenize,
                 config: SpeculativeConfig) -> None:
        if not config.enabled:
            raise ValueError("SpeculativeDecoder needs speculative.mode 'ngram' or 'mtp'")
        self.model = model
        self.eos_id = eos_id
        self.detokenize = detokenize
        self.config = config
        self.drafter = make_drafter(config.mode, model, config.ngram_max, config.ngram_min)
        self.device = next(model.parameters()).device

    def decode(self, rows: list[DecodeRow]) -> None:
        with torch.inference_mode(), InferenceMode.active():
            self._decode(rows)

    def _decode(self, rows: list[DecodeRow]) -> None:
        cap = self.config.longest + 1  # widest window: every draft plus the known token
        tokens, context, wrapper, full = open_batch(self.model, rows, self.device, slack=cap)
        positions = full["position_ids"]  # [B, T]
        policy = CachedPolicy(self.model, context, wrapper, self.drafter.needs_hidden)
        states = [_RowState(DraftLength(self.config), len(r.prompt)) for r in rows]
        live, fed = list(range(len(rows))), len(rows)
        try:
            # The first window reads the shortest prompt for every row, drafting nothing.
            step = _Step(0, min(s.known for s in states), live[:fed], {})
            while True:
                index = torch.tensor(step.slots, device=self.device)
                window = tokens[index, step.offset : step.offset + step.width].clone()  # [k, W]
                for j, r in enumerate(step.slots):
                    if r in step.drafts:
                        at = states[r].known - step.offset
                        new = step.drafts[r].tokens
                        window[j, at : at + len(new)] = torch.tensor(new, device=self.device)
                logits, hidden = policy.forward(
                    window, positions[index, step.offset : step.offset + step.width])
                policy.rollback(self._verify(rows, states, step, logits, hidden, tokens))
                unfinished = [r for r in live[:fed] if rows[r].finish_reason is None]
                if not unfinished:
                    break
                if fed - len(unfinished) >= max(1, fed // 4):
                    compact_cache(context, live, unfinished)
                    fed = len(unfinished)
                step = self._plan(rows, states, policy.offset, live[:fed], cap)
        finally:
            policy.close()
        for row, s in zip(rows, states, strict=True):
            row.speculation = SpeculationStats(s.drafted, s.accepted, s.steps, len(row.token_ids))

    def _plan(self, rows: list[DecodeRow], states: list[_RowState], offset: int,
              slots: list[int], cap: int) -> _Step:
        """Ask the drafter for each running row's drafts; size the window to fit them."""
        requests: list[DraftRequest] = []
        asking: list[int] = []
        widest = 1
        for r in slots:
            row, state = rows[r], states[r]
            if row.finish_reason is not None:
                continue
            pending = state.known - offset  # >= 1: the newest token is never cached yet
            widest = max(widest, pending)
            # A draft may be the last token allowed: the bonus is then cut by the length stop.
            want = min(state.length.current, row.max_tokens - len(row.token_ids), cap - pending)
            if want > 0:
                asking.append(r)
                requests.append(DraftRequest(row.prompt + row.token_ids, want, row.sampling,
                                             state.hidden))
        drafts = dict(zip(asking, self.drafter.propose(requests), strict=True))
        for r, draft in drafts.items():
            widest = max(widest, states[r].known - offset + len(draft.tokens))
        return _Step(offset, min(widest, cap), slots, drafts)

    def _verify(self, rows: list[DecodeRow], states: list[_RowState], step: _Step,
                logits: torch.Tensor, hidden: torch.Tensor | None,
                tokens: torch.Tensor) -> int:
        """Accept drafts, emit tokens and logprobs; the cache length valid for all rows.

        logits: [k, W, V]; hidden: [W, k, H] or None.
        """
        picks: list[tuple[int, int, int]] = []  # (slot j, row r, first window position)
        for j, r in enumerate(step.slots):
            pending = states[r].known - step.offset
            if rows[r].finish_reason is None and pending <= step.width:
                picks.append((j, r, pending - 1))
        spans = [len(step.drafts[r].tokens) + 1 if r in step.drafts else 1 for _, r, _ in picks]
        # Policy distributions at every scored position of every picked row: [sum(spans), V].
        scored = torch.cat([logits[j, at : at + n] for (j, _, at), n in zip(picks, spans,
                                                                             strict=True)])
        samplings = [rows[r].sampling for (_, r, _), n in zip(picks, spans, strict=True)
                     for _ in range(n)]
        p_all = policy_probs(scored, samplings).split(spans)
        emitted: list[tuple[int, int]] = []  # (index into `scored`, token)
        base = 0
        for (j, r, at), n, p in zip(picks, spans, p_all, strict=True):
            draft = step.drafts.get(r, Draft([]))
            accepted, extra = accept_drafts(p, draft.tokens, draft.probs,
                                            rows[r].sampling.generator)
            state = states[r]
            for i, token in enumerate([*draft.tokens[:accepted], extra]):
                tokens[r, state.known + i] = token
                rows[r].token_ids.append(token)
                emitted.append((base + i, token))
                check_stop(rows[r], self.eos_id, self.detokenize)
                if rows[r].finish_reason is not None:
                    break
            state.known += accepted
            if hidden is not None:
                state.hidden = hidden[at + accepted, j].clone()  # produced `extra`
            if draft.tokens:
                state.drafted += len(draft.tokens)
                state.accepted += accepted
                state.length.update(len(draft.tokens), accepted)
            state.steps += 1
            base += n
        self._append_logprobs(rows, picks, spans, emitted, scored, samplings)
        picked = {r for _, r, _ in picks}
        valid = [step.offset + step.width]
        for r in step.slots:
            if rows[r].finish_reason is None:
                # The cache holds the known tokens and the accepted drafts (`known` now
                # counts both); the policy's own token is fed next step.
                valid.append(min(states[r].known, step.offset + step.width))
                states[r].known += r in picked
        return min(valid)

    @staticmethod
    def _append_logprobs(rows: list[DecodeRow], picks: list[tuple[int, int, int]],
                         spans: list[int], emitted: list[tuple[int, int]],
                         scored: torch.Tensor, samplings: list[RowSampling]) -> None:
        """Logprobs of every emitted token, in one call, appended row by row."""
        if not emitted:
            return
        at = torch.tensor([i for i, _ in emitted], device=scored.device)
        chosen = torch.tensor([t for _, t in emitted], device=scored.device)
        values = token_logprobs(scored[at], [samplings[i] for i, _ in emitted], chosen).tolist()
        owner = [r for (_, r, _), n in zip(picks, spans, strict=True) for _ in range(n)]
        for (i, _), value in zip(emitted, values, strict=True):
            rows[owner[i]].logprobs.append(value)
