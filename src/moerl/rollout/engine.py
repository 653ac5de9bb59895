"""The rollout engine seam, and the engine that serves the Megatron model itself.

`MegatronEngine` generates with the trainer's own `GPTModel` (built by
`models.build`, weights read by `models.weights`), so there is no conversion
between what is trained and what is served. The backend is chosen at run time:
Megatron's dynamic engine (paged KV cache, continuous batching) where a GPU with
flash attention is present, the static-context decoder elsewhere.

Generation and weight loading take the same lock: a batch is produced entirely
by one set of weights, and every `Sample` names that version.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, Protocol

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel

from moerl.data.tokenizer import Tokenizer
from moerl.models.arch import MoEArch
from moerl.models.precision import PrecisionConfig
from moerl.rollout.dynamic_decode import DynamicDecoder, dynamic_missing
from moerl.rollout.ranks import Command, RolloutRanks, WeightLoadError, serving_layout
from moerl.rollout.routing_capture import RoutingCapture
from moerl.rollout.sampling import RowSampling
from moerl.rollout.speculative.config import SpeculativeConfig
from moerl.rollout.speculative_decode import SpeculativeDecoder
from moerl.rollout.static_decode import DecodeRow, StaticDecoder
from moerl.rollout.types import GenerationRequest, LogprobMode, RequestError, Sample
from moerl.rollout.weight_group import GroupSpec, Manifest, abort
from moerl.rollout.weight_receive import ReceiveLink, install, join, stage

log = logging.getLogger(__name__)

Backend = Literal["auto", "static", "dynamic"]


class RolloutEngine(Protocol):
    """Anything that turns prompts into sampled completions from versioned weights."""

    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        """One group of `request.sampling.n` samples per request, in order."""
        ...

    def load_weights(self, path: str | Path, version: int) -> None: ...


class EngineBroken(RuntimeError):
    """The weights are in an unknown state (a failed update could not be undone)."""


@dataclass(frozen=True)
class EngineOptions:
    max_batch: int = 32  # rows (prompt x sample) per forward
    backend: Backend = "auto"
    logprob_mode: LogprobMode = "policy"  # default for requests that do not say
    # Drafts verified by the policy (static backend); samples keep the policy's distribution.
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Partial rollouts: a weight update lands between two decode steps of a running
    # batch (`between_steps`), and every token records the version that sampled it.
    partial_rollouts: bool = False


class MegatronEngine:
    """`RolloutEngine` on the `GPTModel` this process holds: the whole model, or with
    `ranks` this rank's shard of it (see `rollout.ranks`; then this engine is the
    leader's, or a follower's driven by `ranks.follow`)."""

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
        """Partial rollouts: called by the decoder after every step (the server's
        scheduler runs the weight updates waiting for it)."""
        self.broken: str | None = None
        backend = self.options.backend
        if backend == "auto" and self.options.speculative.enabled:
            backend = "static"  # Megatron's dynamic engine has its own (MTP) speculation
        self.backend = self._resolve_backend(backend)
        eos = tokenizer.eos_id
        speculative = self.options.speculative
        if speculative.enabled and self.backend == "dynamic":
            raise ValueError("speculative decoding runs on the static backend; set "
                             "backend='static' or speculative.mode='none'")
        if self.ranks is not None and (speculative.enabled or self.backend != "static"):
            raise ValueError("a rollout server across ranks runs the static decoder: set "
                             "backend='static' and speculative.mode='none', or serve on one "
                             "rank")
        self._decoder: StaticDecoder | DynamicDecoder | SpeculativeDecoder
        self.capture: RoutingCapture | None = None  # the static decoder's routed experts
        if speculative.enabled:
            self._decoder = SpeculativeDecoder(model, eos, tokenizer.decode, speculative)
        elif self.backend == "dynamic":
            self._decoder = DynamicDecoder(
                model, eos, tokenizer.decode, tokenizer.encode, self.options.max_batch,
                max_sequence_length, self.options.logprob_mode)
        else:
            agree = self.ranks.agree_samples if self.ranks is not None else None
            self.capture = RoutingCapture(model)
            self._decoder = StaticDecoder(model, eos, tokenizer.decode, agree, self.capture)
            self._decoder.version = lambda: self._version
            self._decoder.between_steps = self._between_steps
        if self.options.partial_rollouts and (self.capture is None or self.ranks is not None):
            raise ValueError("partial rollouts run on the static decoder of a one-process "
                             "server: backend='static', no speculative decoding, one rank")
        model.eval()

    @staticmethod
    def _resolve_backend(backend: Backend) -> Literal["static", "dynamic"]:
        if backend == "auto":
            missing = dynamic_missing()
            if missing is not None:
                log.info("rollout backend: static KV-cache decoder (dynamic engine: %s)", missing)
                return "static"
            return "dynamic"
        return backend

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
        if params.return_routed_experts:
            self._check_routing()

    def _check_routing(self) -> None:
        """The routed experts come from the static decoder on a whole model."""
        why = None
        if self.capture is None:
            why = ("the static backend without speculative decoding captures them; serve "
                   "with --backend static and no --speculative")
        elif not self.capture.routers:
            why = "this model has no MoE layer"
        elif self.ranks is not None and ps.get_pipeline_model_parallel_world_size() > 1:
            why = "a server with pipeline stages holds each layer's routers on one stage only"
        if why is not None:
            raise RequestError(f"return_routed_experts: not available here: {why}")

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        for request in requests:
            self.check(request)
        # A request without a seed gets one here, so every rank samples alike.
        seeded = [r if r.sampling.seed is not None else
                  replace(r, sampling=replace(r.sampling, seed=secrets.randbits(62)))
                  for r in requests]  # fmt: skip
        with self.lock:
            if self.broken is not None:
                raise EngineBroken(self.broken)
            if self.ranks is not None:
                self.ranks.send(Command("generate", tuple(seeded)))
            return self.run_batch(seeded)

    def run_batch(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """Decode seeded `requests` (on every rank of a server across ranks at once)."""
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
        for i in range(0, len(flat), self.options.max_batch):
            self._decoder.decode(flat[i : i + self.options.max_batch])
        return [[self._sample(row, version) for row in group] for group in rows]

    def _sample(self, row: DecodeRow, version: int) -> Sample:
        assert row.finish_reason is not None
        routed = None
        if row.sampling.params.return_routed_experts and self.capture is not None:
            routed = self.capture.pack(row.routing)
        partial = self.options.partial_rollouts and bool(row.versions)
        return Sample(
            prompt_token_ids=tuple(row.prompt),
            token_ids=tuple(row.token_ids),
            logprobs=tuple(row.logprobs),
            finish_reason=row.finish_reason,
            weight_version=row.versions[0] if partial else version,
            text=row.text,
            speculation=row.speculation,
            routed_experts=routed,
            token_versions=tuple(row.versions) if partial else None,
        )

    def _between_steps(self) -> None:
        if self.options.partial_rollouts and self.between_steps is not None:
            self.between_steps()

    def load_weights(self, path: str | Path, version: int) -> None:
        """Swap in the weights at `path` (a `models.weights` checkpoint) as `version`.

        A failed load leaves the old weights and version: they are read back from
        their own checkpoint (or from a host copy when they were a random init).
        """
        from moerl.models.weights_marker import is_complete

        path = Path(path)
        if not is_complete(path):
            raise FileNotFoundError(f"{path} is not a complete weights checkpoint")
        with self.lock:
            if self.ranks is not None:
                self.ranks.send(Command("load", path=str(path), version=version))
            self.load_on_every_rank(path, version)

    def load_on_every_rank(self, path: str | Path, version: int) -> None:
        """This rank's shard of `path`; all ranks keep the old weights unless every
        rank loaded its shard."""
        from moerl.models.weights import load_weights

        path = Path(path)
        backup = None
        if self._weights_path is None:
            backup = {k: v.detach().to("cpu", copy=True)
                      for k, v in self.model.state_dict().items() if torch.is_tensor(v)}
        error: BaseException | None = None
        try:
            load_weights([self.model], path)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            error = exc
        loaded = error is None
        if self.ranks is not None:
            loaded = self.ranks.all_ok(loaded)
        if not loaded:
            self._restore(backup)
            why = ("another rank failed" if error is None else
                   str(error).splitlines()[0] if str(error) else repr(error))
            raise WeightLoadError(f"loading {path} as version {version} failed: {why}") \
                from error
        self._weights_path, self._version = path, version
        self.model.eval()

    def join_weight_group(self, spec: GroupSpec) -> None:
        """Join the trainer's weight group (`rollout.weight_group`), every rank of the
        server at once, and agree what each rank takes from which trainer rank; returns
        when the whole group has joined."""
        with self.lock:
            if self.ranks is not None:
                self.ranks.send(Command("join", group=spec))
            self.join_on_every_rank(spec)

    def join_on_every_rank(self, spec: GroupSpec) -> None:
        """Raises WeightLoadError on every rank unless every rank joined."""
        if self.arch is None:
            raise WeightLoadError("this engine was built without its architecture; a weight "
                                  "group needs it")
        self._drop_link()
        rank = spec.rank_offset + (self.ranks.rank if self.ranks is not None else 0)
        problem = None
        try:
            self._link = join(spec, rank, self.model, self.arch)
        except Exception as exc:
            problem = f"joining weight group {spec.group_name}: {exc}"
        if not self._all_ok(problem is None):
            self._drop_link()
            raise WeightLoadError(problem or "another rank of this server could not join")

    def receive_weights(self, manifest: Manifest) -> None:
        """Take version `manifest.version` from the weight group: every tensor arrives
        before any parameter changes, so a failure leaves the old version whole."""
        with self.lock:
            if self.ranks is not None:
                self.ranks.send(Command("receive", manifest=manifest))
            self.receive_on_every_rank(manifest)

    def receive_on_every_rank(self, manifest: Manifest) -> None:
        """Raises WeightLoadError on every rank (old weights kept) unless every rank
        received its whole shard; a failed group is left, the next version joins anew."""
        problem, staged = None, None
        if self._link is None:
            problem = "no weight group joined (POST /init_weights_update_group first)"
        else:
            try:
                staged = stage(self._link, manifest)
            except Exception as exc:
                problem = f"version {manifest.version}: {exc}"
        if not self._all_ok(problem is None) or staged is None:
            self._drop_link()
            raise WeightLoadError(problem or f"version {manifest.version}: another rank of "
                                  "this server did not receive it")
        report = {**staged.traffic.as_dict(), "held_bytes": staged.held_bytes}
        self.last_received = (self.ranks.gather_counts(report) if self.ranks is not None
                              else [report])
        install(staged)
        self._weights_path, self._version = None, manifest.version
        self.model.eval()

    def _all_ok(self, ok: bool) -> bool:
        return self.ranks.all_ok(ok) if self.ranks is not None else ok

    def _drop_link(self) -> None:
        if self._link is not None:
            abort(self._link.group)
            self._link = None

    def _restore(self, backup: dict[str, torch.Tensor] | None) -> None:
        from moerl.models.weights import load_weights

        try:
            if backup is not None:
                self.model.load_state_dict(backup, strict=False)
            elif self._weights_path is not None:
                load_weights([self.model], self._weights_path)
        except BaseException as exc:  # the model now holds a mix of two versions
            self.broken = f"weight update failed and the old weights could not be restored: {exc}"
            raise EngineBroken(self.broken) from exc


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
    # engine's flash attention takes fp16/bf16 only. CPU keeps fp32.
    (model,) = build_model(arch, layout, precision=resolve_precision(precision),
                           backend=groups.backend)
    if weights is not None:
        load_weights([model], weights)
    return MegatronEngine(model, tokenizer, arch.max_position_embeddings, options,
                          weights_path=weights, ranks=ranks, arch=arch)
