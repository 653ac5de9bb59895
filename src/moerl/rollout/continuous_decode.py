"""Continuous batching with chunked prefill over a paged KV cache (the CPU path, any device).

Sequences join between steps (`add`) and leave as soon as they finish. Every step is
one forward of at most `step_tokens` tokens: first one token of every decoding
sequence, then chunks of prompts in arrival order (a prompt is read in one forward, or
in several of at most the remaining budget: chunked prefill). A sequence samples when
its last fed token is its last token, so a prompt costs forwards by chunks, not a
decode step per token.

Memory decides how many sequences run, not a row count: a sequence is admitted when the
cache has blocks for its prompt (and `max_rows` is not reached). A decoding sequence
that needs a new block when none is free preempts the latest admitted one, whose blocks
go back to the pool; it is re-admitted later and re-reads its prompt and the tokens it
had sampled (its random stream and logprobs so far are kept). Copies of one prompt are
prefilled once (`sequences`).

A row's tokens depend only on its own logits and generator (`sampling`), not on which
other rows share a step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.gpt import GPTModel

from moerl.rollout.paged_cache import PagedKVCache
from moerl.rollout.routing_capture import RoutingCapture
from moerl.rollout.sampling import choose_tokens
from moerl.rollout.sequences import Sequence, SequenceBlocks
from moerl.rollout.serving_model import ServingModel
from moerl.rollout.static_decode import AgreeSamples, DecodeRow, Detokenize, check_stop
from moerl.rollout.step_plan import Segment, StepPlan, plan_step


@dataclass(frozen=True)
class ContinuousOptions:
    step_tokens: int = 2048  # tokens per forward: decode tokens first, then prompt chunks
    max_rows: int = 1024  # sequences admitted at once (block-table rows)
    block_size: int = 16  # tokens per KV block
    watermark: float = 0.01  # share of blocks admission leaves free for decoding rows

    def __post_init__(self) -> None:
        for name in ("step_tokens", "max_rows", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


class ContinuousDecoder:
    """Steps `DecodeRow`s through a `ServingModel`; see the module docstring."""

    def __init__(self, model: GPTModel, cache: PagedKVCache, eos_id: int | None,
                 detokenize: Detokenize, options: ContinuousOptions,
                 agree: AgreeSamples | None = None, capture: RoutingCapture | None = None
                 ) -> None:
        self.serving = ServingModel(model, cache)
        self.eos_id, self.detokenize = eos_id, detokenize
        self.options = options
        self.blocks = SequenceBlocks(cache, model.max_sequence_length, options.max_rows)
        self.agree, self.capture = agree, capture
        self.device = cache.store.device
        self.version: Callable[[], int] = lambda: 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefixes: dict[tuple[int, ...], Sequence] = {}
        self._admissions = 0
        self.forwards = 0
        self.prefill_forwards = 0  # forwards that read prompt tokens
        self.prefill_tokens = 0  # prompt tokens read (a shared prompt counts once)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, rows: list[DecodeRow]) -> None:
        for row in rows:
            self.waiting.append(Sequence(row, list(row.prompt), prompt_key=tuple(row.prompt)))

    def decode(self, rows: list[DecodeRow]) -> None:
        """Run `rows` (and whatever else is queued) to completion."""
        self.add(rows)
        while any(r.finish_reason is None for r in rows):
            self.step()

    def forget_prefixes(self) -> None:
        """New weights: prompts cached from now on are not the old ones'."""
        self.prefixes.clear()

    def drop_all(self) -> list[DecodeRow]:
        """Let every sequence go (after a failed step); their rows, unfinished."""
        rows = [s.row for s in [*self.running, *self.waiting]]
        for seq in self.running:
            self.blocks.release(seq)
        self.running.clear()
        self.waiting.clear()
        self.prefixes.clear()
        return rows

    def step(self, forward_anyway: bool = False) -> list[DecodeRow]:
        """One forward of the running sequences; the rows that finished in it.

        `forward_anyway`: with nothing to run, a forward of one stand-in token all the
        same (a rank of an expert-parallel group whose other ranks step: their MoE
        layers' collectives need every rank's)."""
        with torch.inference_mode(), InferenceMode.active():
            self._admit()
            segments = self._schedule()
            if segments:
                return self._run(segments)
            if self.waiting and not self.running:
                raise RuntimeError("the KV cache cannot hold the next prompt; raise "
                                   "--kv-cache-gb or shorten it")
            if forward_anyway:
                plan = plan_step([Segment(self.blocks.idle_row, 0, [0])], self.blocks.table,
                                 self.blocks.block_size)
                self._forward(plan, torch.zeros(0, dtype=torch.long, device=self.device),
                              capture=False)
            return []

    # -- admission and scheduling ---------------------------------------------------

    def _admit(self) -> None:
        pool = self.blocks.cache.pool
        reserve = int(self.options.watermark * pool.usable)
        while self.waiting and len(self.running) < self.options.max_rows:
            seq = self.waiting[0]
            leader = self._leader_for(seq)
            need = 1 if leader is not None else self.blocks.blocks_for(len(seq.tokens))
            if self.running and pool.free - need < reserve:
                return
            if not self.blocks.take_row(seq, 1 if leader is not None else len(seq.tokens)):
                return
            self.waiting.popleft()
            seq.admitted, self._admissions = self._admissions, self._admissions + 1
            self.running.append(seq)
            if leader is None:
                if seq.prompt_key is not None:
                    self.prefixes[seq.prompt_key] = seq
            elif leader.fed < len(leader.row.prompt):  # still reading its prompt
                seq.leader = leader
                leader.followers.append(seq)
            else:  # it has moved on: take all but the last prompt token, re-feed that one
                self.blocks.adopt(seq, leader, len(seq.row.prompt) - 1)
                self._copy_routing(seq, leader, len(seq.row.prompt) - 1)

    def _leader_for(self, seq: Sequence) -> Sequence | None:
        """The live copy of `seq`'s prompt to share, if any (one that recorded its
        routed experts, when `seq` wants them)."""
        leader = self.prefixes.get(seq.prompt_key) if seq.prompt_key else None
        wants = seq.row.sampling.params.return_routed_experts
        if leader is not None and wants and leader.captured < leader.fed:
            return None
        return leader

    def _schedule(self) -> list[Segment]:
        """This step's segments: a token of every decoding sequence, then prompt chunks."""
        budget = self.options.step_tokens
        chosen: list[tuple[Sequence, int]] = []
        for seq in [s for s in self.running if s.leader is None and s.remaining == 1]:
            if budget == 0:
                break
            while seq.table_row >= 0 and not self.blocks.cover(seq, seq.fed + 1):
                self._preempt(spare=seq)
            if seq.table_row >= 0:
                chosen.append((seq, 1))
                budget -= 1
        for seq in self.running:
            if budget == 0:
                break
            if seq.leader is None and seq.remaining > 1:
                count = min(seq.remaining, budget)
                if self.blocks.cover(seq, seq.fed + count):  # taken at admission
                    chosen.append((seq, count))
                    budget -= count
        # A preemption frees the latest admitted: never one chosen before it.
        return [Segment(s.table_row, s.fed, s.tokens[s.fed: s.fed + n])
                for s, n in chosen if s.table_row >= 0]

    def _preempt(self, spare: Sequence) -> None:
        """Free the blocks of the latest admitted sequence past its prompt (`spare`
        last of all) and queue it again, first."""
        victims = [s for s in self.running if s.leader is None and s.fed >= len(s.row.prompt)]
        victims.sort(key=lambda s: (s is not spare, s.admitted))
        victim = victims[-1] if victims else spare
        for seq in [*victim.followers, victim]:  # followers wait for a prompt it reads
            self.blocks.release(seq)
            self.running.remove(seq)
            if seq.prompt_key is not None and self.prefixes.get(seq.prompt_key) is seq:
                del self.prefixes[seq.prompt_key]
            if len(seq.tokens) > len(seq.row.prompt):  # no longer a plain prompt
                seq.prompt_key = None
            seq.fed, seq.leader, seq.followers = 0, None, []
            self.waiting.appendleft(seq)

    # -- the forward and what follows it --------------------------------------------

    def _run(self, segments: list[Segment]) -> list[DecodeRow]:
        by_row = {s.table_row: s for s in self.running}
        plan = plan_step(segments, self.blocks.table, self.blocks.block_size)
        sequences = [by_row[seg.row] for seg in plan.segments]
        done = [j for j, (seq, seg) in enumerate(zip(sequences, plan.segments, strict=True))
                if seg.start + len(seg.tokens) == len(seq.tokens)]
        prompt = sum(min(len(seg.tokens), max(0, len(seq.row.prompt) - seg.start))
                     for seq, seg in zip(sequences, plan.segments, strict=True))
        self.prefill_forwards += prompt > 0
        self.prefill_tokens += prompt
        at = torch.tensor([plan.last_token[j] for j in done], dtype=torch.long,
                          device=self.device)
        logits = self._forward(plan, at, capture=True, sequences=sequences)
        for seq, seg in zip(sequences, plan.segments, strict=True):
            seq.fed = seg.start + len(seg.tokens)
        # Each finished prompt hands its cache and its logits row to its followers.
        samplers: list[Sequence] = []
        rows: list[int] = []
        for i, j in enumerate(done):
            seq = sequences[j]
            for follower in seq.followers:
                self.blocks.adopt(follower, seq, seq.fed)
                self._copy_routing(follower, seq, seq.fed)
                follower.leader = None
                samplers.append(follower)
                rows.append(i)
            seq.followers = []
            samplers.append(seq)
            rows.append(i)
        if not samplers:
            return []
        return self._sample(samplers, logits[torch.tensor(rows, device=logits.device)]
                            if logits.numel() else None)

    def _forward(self, plan: StepPlan, logits_at: torch.Tensor, capture: bool,
                 sequences: list[Sequence] | None = None) -> torch.Tensor:
        on = capture and self.capture is not None and any(
            s.row.sampling.params.return_routed_experts for s in self.running)
        if self.capture is not None:
            self.capture.on = on
        logits = self.serving.forward(plan, logits_at)
        self.forwards += 1
        if on and sequences is not None:
            assert self.capture is not None
            ids = self.capture.take_tokens()  # (MoE layers, T, top-k)
            start = 0
            for seq, seg in zip(sequences, plan.segments, strict=True):
                skip = max(0, seq.captured - seg.start)  # re-read after a preemption
                if skip < len(seg.tokens):
                    seq.row.routing.append(ids[:, start + skip: start + len(seg.tokens)])
                    seq.captured = seg.start + len(seg.tokens)
                start += len(seg.tokens)
        return logits

    def _copy_routing(self, follower: Sequence, leader: Sequence, positions: int) -> None:
        if leader.row.routing and follower.row.sampling.params.return_routed_experts:
            follower.row.routing = [torch.cat(leader.row.routing, dim=1)[:, :positions]]
            follower.captured = positions

    def _sample(self, samplers: list[Sequence], logits: torch.Tensor | None) -> list[DecodeRow]:
        """Draw each sampler's next token from its logits row [k, V]; the finished rows."""
        new = logprobs = None
        if logits is not None:
            new, logprobs = choose_tokens(logits, [s.row.sampling for s in samplers])
        if self.agree is not None:
            new, logprobs = self.agree(new, logprobs, len(samplers))
        assert new is not None and logprobs is not None
        version = self.version()
        finished = []
        for seq, token, logprob in zip(samplers, new.tolist(), logprobs.tolist(), strict=True):
            row = seq.row
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            row.versions.append(version)
            seq.tokens.append(token)
            check_stop(row, self.eos_id, self.detokenize)
            if row.finish_reason is not None:
                finished.append(row)
                self._finish(seq)
        return finished

    def _finish(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        self.running.remove(seq)
        if seq.prompt_key is not None and self.prefixes.get(seq.prompt_key) is seq:
            del self.prefixes[seq.prompt_key]
