"""The rollout engine seam, and the engine that serves the Megatron model itself.

`MegatronEngine` generates with the trainer's own `GPTModel` (built by
`models.build`, weights read by `models.weights`), so there is no conversion
between what is trained and what is served. The backend is chosen at run time
(`options`): Megatron's dynamic engine where a GPU with flash attention is present,
the continuous engine elsewhere (continuous batching, chunked prefill, a paged KV
cache, shared prompts; data-parallel attention across ranks), the static decoder for
pipeline stages and speculative decoding.

Generation, steps and weight loading take the same lock: a step runs on one set of
weights, and every `Sample` names the versions its tokens came from.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel

from moerl.data.tokenizer import Tokenizer
from moerl.models.arch import MoEArch
from moerl.models.precision import PrecisionConfig
from moerl.rollout.continuous_decode import ContinuousDecoder
from moerl.rollout.continuous_runner import ContinuousRunner
from moerl.rollout.decoders import build_continuous, resolve_backend, wants_dynamic
from moerl.rollout.dynamic_decode import DynamicDecoder
from moerl.rollout.engine_weights import EngineBroken, WeightUpdates
from moerl.rollout.options import STATIC_BATCH, Backend, EngineOptions
from moerl.rollout.ranks import Command, RolloutRanks, WeightLoadError, serving_layout
from moerl.rollout.routing_capture import RoutingCapture
from moerl.rollout.sampling import RowSampling
from moerl.rollout.speculative_decode import SpeculativeDecoder
from moerl.rollout.static_decode import DecodeRow, StaticDecoder
from moerl.rollout.types import GenerationRequest, RequestError, Sample
from moerl.rollout.weight_receive import ReceiveLink

__all__ = ["Backend", "EngineBroken", "EngineOptions", "MegatronEngine", "RolloutEngine",
           "WeightLoadError", "build_engine"]

log = logging.getLogger(__name__)


class RolloutEngine(Protocol):
    """Anything that turns prompts into sampled completions from versioned weights."""

    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        """One group of `request.sampling.n` samples per request, in order."""
        ...

    def load_weights(self, path: str | Path, version: int) -> None: ...


class MegatronEngine(WeightUpdates):
    """`RolloutEngine` on the `GPTModel` this process holds: the whole model, or with
    `ranks` this rank's shard of it (see `rollout.ranks`; then this engine is the
    leader's, or a follower's driven by `follower.follow`)."""

    def __init__(self, model: GPTModel, tokenizer: Tokenizer, max_sequence_length: int,
                 options: EngineOptions | None = None, weight_version: int = 0,
                 weights_path: str | Path | None = None,
                 ranks: RolloutRanks | None = None, arch: MoEArch | None = None) -> None:
        self.model = model
        self.arch = arch  # needed by updates over a weight group (global tensor names)
        self._link: ReceiveLink | None = None  # the trainer's weight group, once joined
        # What each rank received of the last streamed version (`weight_transport.Traffic`).
        self.last_received: list[dict[str, int]] = []
        self.ranks = ranks if ranks is not None and ranks.size > 1 else None
        self.tokenizer = tokenizer
        self.max_sequence_length = max_sequence_length
        self.options = options or EngineOptions()
        self._version = weight_version
        self._weights_path = Path(weights_path) if weights_path is not None else None
        # Generation and weight loads, one at a time; re-entrant: with partial rollouts an
        # update runs inside a generation, between two of its decode steps.
        self.lock = threading.RLock()
        self.between_steps: Callable[[], None] | None = None
        """Partial rollouts on the static decoder: called after every step (the server's
        scheduler runs the weight updates waiting for it)."""
        self.broken: str | None = None
        self.backend = resolve_backend(self.options, model, self.ranks is not None)
        self.runner: ContinuousRunner | None = None  # continuous and dynamic backends
        self.continuous: ContinuousDecoder | None = None  # the continuous backend's decoder
        self.capture: RoutingCapture | None = None  # the routed experts, where captured
        self._decoder = self._make_decoder()
        model.eval()

    def _make_decoder(self) -> StaticDecoder | SpeculativeDecoder | None:
        model, tokenizer, options = self.model, self.tokenizer, self.options
        eos = tokenizer.eos_id
        if options.speculative.enabled:
            return SpeculativeDecoder(model, eos, tokenizer.decode, options.speculative)
        if self.backend == "dynamic":
            dynamic = DynamicDecoder(model, eos, tokenizer.decode, tokenizer.encode,
                                     options.max_batch or 256, self.max_sequence_length,
                                     options.logprob_mode, cuda_graphs=options.cuda_graphs,
                                     prefill_chunk=options.prefill_chunk)
            dynamic.version = lambda: self._version
            self.runner = ContinuousRunner(dynamic, self._sample, self.ranks)
            return None
        self.capture = RoutingCapture(model)
        if self.backend == "continuous":
            agree = self.ranks.agree_in_replica if self.ranks is not None else None
            decoder = build_continuous(model, eos, tokenizer.decode, options, self.capture, agree)
            decoder.version = lambda: self._version
            self.continuous = decoder
            self.runner = ContinuousRunner(decoder, self._sample, self.ranks)
            return None
        if options.partial_rollouts and self.ranks is not None:
            raise ValueError("partial rollouts across ranks run on the continuous backend")
        agree = self.ranks.agree_samples if self.ranks is not None else None
        static = StaticDecoder(model, eos, tokenizer.decode, agree, self.capture)
        static.version = lambda: self._version
        static.between_steps = self._between_steps
        return static

    @property
    def weight_version(self) -> int:
        return self._version

    def check(self, request: GenerationRequest) -> None:
        """Reject what this model cannot serve before it reaches a batch."""
        prompt, params = request.prompt_token_ids, request.sampling
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_sequence_length:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.max_sequence_length} tokens"
            )
        if self.continuous is not None:
            cache = self.continuous.blocks.cache
            if len(prompt) + params.max_tokens > cache.token_capacity:
                raise RequestError(
                    f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                    f"this server's KV cache of {cache.token_capacity} tokens; start it with a "
                    "larger --kv-cache-gb")
        if params.return_routed_experts:
            self._check_routing()

    def _check_routing(self) -> None:
        """The routed experts come from the static or continuous decoder."""
        why = None
        if self.capture is None:
            why = ("the continuous or the static backend without speculative decoding "
                   "captures them; serve with --backend continuous and no --speculative")
        elif not self.capture.routers:
            why = "this model has no MoE layer"
        elif self.ranks is not None and ps.get_pipeline_model_parallel_world_size() > 1:
            why = "a server with pipeline stages holds each layer's routers on one stage only"
        if why is not None:
            raise RequestError(f"return_routed_experts: not available here: {why}")

    def _seeded(self, requests: Sequence[GenerationRequest]) -> list[GenerationRequest]:
        """Checked, and each without a seed given one here, so every rank samples alike."""
        for request in requests:
            self.check(request)
        return [r if r.sampling.seed is not None else
                replace(r, sampling=replace(r.sampling, seed=secrets.randbits(62)))
                for r in requests]  # fmt: skip

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        seeded = self._seeded(requests)
        with self.lock:
            if self.broken is not None:
                raise EngineBroken(self.broken)
            if self.runner is not None:
                out: list[list[list[Sample]]] = []
                self.runner.submit(seeded, out.append)
                while not out:
                    self.step()
                return out[0]
            if self.ranks is not None:
                self.ranks.send(Command("generate", tuple(seeded)))
            return self.run_batch(seeded)

    # -- continuous batching: requests join between steps (`ContinuousScheduler`) ------

    def start(self, requests: Sequence[GenerationRequest],
              done: Callable[[list[list[Sample]]], None]) -> None:
        """Queue `requests` on the continuous runner; `done` gets their samples."""
        assert self.runner is not None, "start/step run on the continuous backend"
        seeded = self._seeded(requests)
        with self.lock:
            if self.broken is not None:
                raise EngineBroken(self.broken)
            self.runner.submit(seeded, done)

    def busy(self) -> bool:
        return self.runner is not None and self.runner.busy()

    def step(self) -> None:
        """One step of every running sequence (on every rank).

        Across ranks a leader whose step fails cannot bring the other ranks back in step
        (they wait in the step's collectives): it ends the job, as a failing follower does
        (`follower.follow`), and torchrun stops the rest."""
        assert self.runner is not None
        with self.lock:
            if self.ranks is None:
                self.runner.step()
                return
            try:
                self.runner.step()
            except Exception:
                log.exception("a step failed on the leader; ending the server")
                os._exit(1)

    def abandon(self) -> None:
        """Drop every sequence in flight (after a failed step)."""
        if self.runner is not None:
            with self.lock:
                self.runner.drop_all()

    def _weights_changed(self) -> None:
        if self.runner is not None:  # prompts cached from now on are the new weights'
            self.runner.decoder.forget_prefixes()

    # -- the static decoders -------------------------------------------------------------

    def run_batch(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """Decode seeded `requests` (on every rank of a server across ranks at once)."""
        assert self._decoder is not None
        rows: list[list[DecodeRow]] = []
        for request in requests:
            assert request.sampling.seed is not None
            rows.append([
                DecodeRow(list(request.prompt_token_ids),
                          RowSampling.make(request.sampling, request.sampling.seed, i))
                for i in range(request.sampling.n)
            ])
        version = self._version
        if self.capture is not None:
            self.capture.on = any(r.sampling.return_routed_experts for r in requests)
        flat = [row for group in rows for row in group]
        # Similar prompt lengths share a forward: fewer steps spent reading prompts.
        flat.sort(key=lambda r: len(r.prompt))
        batch = self.options.max_batch or STATIC_BATCH
        for i in range(0, len(flat), batch):
            self._decoder.decode(flat[i : i + batch])
        return [[self._sample(row, version) for row in group] for group in rows]

    def _sample(self, row: DecodeRow, version: int | None = None) -> Sample:
        """`row` as a sample; its weight version is its first token's (or `version`)."""
        assert row.finish_reason is not None
        routed = None
        if row.sampling.params.return_routed_experts and self.capture is not None:
            routed = self.capture.pack(row.routing)
        partial = self.options.partial_rollouts and bool(row.versions)
        first = row.versions[0] if row.versions else self._version
        return Sample(
            prompt_token_ids=tuple(row.prompt),
            token_ids=tuple(row.token_ids),
            logprobs=tuple(row.logprobs),
            finish_reason=row.finish_reason,
            weight_version=first if partial or version is None else version,
            text=row.text,
            speculation=row.speculation,
            routed_experts=routed,
            token_versions=tuple(row.versions) if partial else None,
        )

    def _between_steps(self) -> None:
        if self.options.partial_rollouts and self.between_steps is not None:
            self.between_steps()


def build_engine(preset: str | MoEArch, tokenizer: Tokenizer, *,
                 weights: str | Path | None = None,
                 seed: int = 0, options: EngineOptions | None = None,
                 precision: PrecisionConfig | None = None,
                 tp: int = 1, ep: int = 1, pp: int = 1) -> MegatronEngine:
    """The engine for model `preset`: weights from `weights` (version 0), or a random
    init from `seed`. `precision`: the run's (None: this machine's default, bf16 with
    Transformer Engine where it runs on a GPU, fp32 on CPU). Under torchrun every rank
    calls this and holds its shard of a `tp` x `ep` x `pp` layout (`rollout.ranks`)."""
    import torch.distributed as dist

    from moerl.models.arch import get_preset
    from moerl.models.build import build_model
    from moerl.models.features import resolve_precision
    from moerl.models.weights import load_weights
    from moerl.parallel.groups import init_parallel

    arch = get_preset(preset) if isinstance(preset, str) else preset
    if tokenizer.vocab_size > arch.vocab_size:
        raise ValueError(
            f"tokenizer vocabulary ({tokenizer.vocab_size}) is larger than model {arch.name!r}'s "
            f"({arch.vocab_size})"
        )
    layout = serving_layout(arch, int(os.environ.get("WORLD_SIZE", "1")), tp, ep, pp)
    groups = init_parallel(layout, seed=seed)
    ranks = RolloutRanks() if dist.get_world_size() > 1 else None
    # On a GPU the model runs in bf16 by default (as the trainer does): the dynamic
    # engine's flash attention takes fp16/bf16 only. CPU keeps fp32. The dynamic engine
    # captures CUDA graphs of layers built for them (the weights are the same).
    options = options or EngineOptions()
    overrides: dict[str, Any] = {}
    if wants_dynamic(options, pp) and options.cuda_graphs > 0:
        overrides["cuda_graph_impl"] = "local"
    (model,) = build_model(arch, layout, precision=resolve_precision(precision),
                           backend=groups.backend, **overrides)
    if weights is not None:
        load_weights([model], weights)
    return MegatronEngine(model, tokenizer, arch.max_position_embeddings, options,
                          weights_path=weights, ranks=ranks, arch=arch)
