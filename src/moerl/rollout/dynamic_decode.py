"""Decoding on Megatron's dynamic inference engine: paged KV cache, continuous batching,
chunked prefill, prefix caching and CUDA graphs (GPU).

Selected at run time when a GPU and flash attention are present; elsewhere the
continuous engine (`continuous_decode`) runs, and asking for this one fails with
`DynamicUnavailable` naming what is missing. It cannot run on the CPU machine the
tests use; `scripts/gpu_smoke_rollout.py` is where it is exercised.

It has the continuous decoder's step interface (`add`, `step`, `has_work`), so the
same runner drives it, on one rank or across the ranks of a server: each attention
replica runs an engine of its own on its own requests, and a rank with none runs the
engine's own stand-in forward (`dummy_forward`) so its MoE layers' all-to-alls pair with
the others'. Megatron's prefix caching shares the blocks of a prompt's copies; after a
weight update (which waits for the engine to drain) the engine is reset, so no cached
prompt of the old weights is reused. CUDA graphs (`cuda_graphs`) need the model built
with `cuda_graph_impl="local"` (`build_engine` does so when this backend will run).

Differences from the continuous engine, all from Megatron's engine itself:
- sampling uses one generator per engine (`inference_sampling_seed`), so a
  request's `seed` does not make it reproducible on its own; the engine is
  re-seeded from the seed of each request it is given;
- the logprob mode is fixed per engine (`InferenceConfig.logprobs_mode`:
  "raw_logprobs" is our "policy"; "processed_logprobs" follows the engine's
  own post-filter definition);
- MLA caches per-head keys and values: Megatron's latent cache (`cache_mla_latents`)
  replaces the up-projection modules at the first forward, which in-place weight
  updates would then miss.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from moerl.rollout.static_decode import DecodeRow, Detokenize, check_stop
from moerl.rollout.types import LogprobMode, RequestError, SamplingParams

_FLASH_MODULES = ("flash_attn", "flash_attn_3", "flashattn_hopper")


class DynamicUnavailable(RuntimeError):
    """The dynamic engine was asked for where it cannot run."""


def dynamic_missing() -> str | None:
    """Why the dynamic engine cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "no GPU is present"
    if not any(importlib.util.find_spec(m) for m in _FLASH_MODULES):
        return f"flash attention is not installed (one of {', '.join(_FLASH_MODULES)})"
    return None


class _EngineTokenizer:
    """The few tokenizer members Megatron's controller calls (stop words, EOD)."""

    def __init__(self, eos_id: int | None, detokenize: Detokenize, encode: Any) -> None:
        self.eod = -1 if eos_id is None else eos_id
        self.bos = None
        self._detokenize = detokenize
        self._encode = encode

    def detokenize(self, ids: list[int], **_: Any) -> str:
        return self._detokenize(list(ids))

    def tokenize(self, text: str) -> list[int]:
        return list(self._encode(text))


class DynamicDecoder:
    """Runs `DecodeRow`s through one long-lived `DynamicInferenceEngine`, a step at a time."""

    def __init__(self, model: GPTModel, eos_id: int | None, detokenize: Detokenize,
                 encode: Any, max_batch: int, max_sequence_length: int,
                 logprob_mode: LogprobMode = "policy", buffer_size_gb: float = 8.0,
                 cuda_graphs: int = 0, prefill_chunk: int | None = None) -> None:
        missing = dynamic_missing()
        if missing is not None:
            raise DynamicUnavailable(
                f"rollout backend 'dynamic' needs a GPU with flash attention, but {missing}; "
                "use --backend continuous (or auto)"
            )
        from megatron.core.inference.config import InferenceConfig
        from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
        from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
            GPTInferenceWrapper,
        )
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (
            TextGenerationController,
        )

        self.eos_id = eos_id
        self.detokenize = detokenize
        self.logprob_mode = logprob_mode
        config = InferenceConfig(
            max_sequence_length=max_sequence_length,
            max_requests=max_batch,
            max_tokens=prefill_chunk,
            buffer_size_gb=buffer_size_gb,
            materialize_only_last_token_logits=True,
            logprobs_mode="raw_logprobs" if logprob_mode == "policy" else "processed_logprobs",
            enable_chunked_prefill=prefill_chunk is not None,
            enable_prefix_caching=True,
            num_cuda_graphs=cuda_graphs or None,
        )
        context = DynamicInferenceContext(model.config, config)
        wrapper = GPTInferenceWrapper(model, context)
        tokenizer = _EngineTokenizer(eos_id, detokenize, encode)
        self.controller = TextGenerationController(wrapper, tokenizer)
        self.engine = DynamicInferenceEngine(self.controller, context)
        self._rows: dict[int, DecodeRow] = {}
        self._next_id = 0
        self.version: Callable[[], int] = lambda: 0
        """The weights' version now (the engine's), recorded with every token."""
        self._forwarded = False
        # Set by every forward, the engine's stand-in included: did a step run one?
        model.register_forward_pre_hook(self._saw_forward)

    def _saw_forward(self, *_: Any) -> None:
        self._forwarded = True

    def has_work(self) -> bool:
        return bool(self._rows)

    def add(self, rows: list[DecodeRow]) -> None:
        for row in rows:
            params = row.sampling.params
            if params.logprob_mode != self.logprob_mode:
                raise RequestError(
                    f"logprob_mode {params.logprob_mode!r}: this dynamic-engine server serves "
                    f"{self.logprob_mode!r} only"
                )
            if params.seed is not None:
                self.controller.sampling_rng.manual_seed(params.seed)
            self._next_id += 1
            self._rows[self._next_id] = row
            self.engine.add_request(self._next_id, list(row.prompt), _engine_sampling(
                params, self.eos_id))

    def step(self, forward_anyway: bool = False) -> list[DecodeRow]:
        """One engine step; the rows that finished in it. `forward_anyway`: a rank whose
        engine ran no forward runs the stand-in one (its expert-parallel peers step)."""
        self._forwarded = False
        finished = []
        if self._rows:
            result = self.engine.step_modern()
            for record in result["finished_request_records"]:
                done = record.merge()
                row = self._rows.pop(done.request_id)
                self._finish(row, done)
                finished.append(row)
        if forward_anyway and not self._forwarded:
            self.controller.dummy_forward()
        return finished

    def decode(self, rows: list[DecodeRow]) -> None:
        """Run `rows` to completion."""
        self.add(rows)
        while any(row.finish_reason is None for row in rows):
            self.step()

    def drop_all(self) -> list[DecodeRow]:
        rows, self._rows = list(self._rows.values()), {}
        self.engine.reset()
        return rows

    def forget_prefixes(self) -> None:
        """New weights (the engine has drained): cached prompts are the old weights'."""
        assert not self._rows, "weights change between steps of a drained dynamic engine"
        self.engine.reset()

    def _finish(self, row: DecodeRow, done: Any) -> None:
        tokens = [int(t) for t in done.generated_tokens]
        logprobs = [float(x) for x in done.generated_log_probs]
        version = self.version()  # updates wait for the engine to drain
        # Replay our stop rules over the engine's tokens so both paths agree on the
        # cut, the finish reason and the text (stop token ids are ours, not the engine's).
        for token, logprob in zip(tokens, logprobs, strict=False):
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            row.versions.append(version)
            check_stop(row, self.eos_id, self.detokenize)
            if row.finish_reason is not None:
                return
        row.finish_reason = "length"
        row.text = self.detokenize(row.token_ids)


def _engine_sampling(params: SamplingParams, eos_id: int | None) -> Any:
    """Megatron's sampling parameters for ours (greedy as top-k 1)."""
    from megatron.core.inference.sampling_params import SamplingParams as MSampling

    greedy = params.temperature == 0
    return MSampling(
        temperature=1.0 if greedy else params.temperature,
        top_k=1 if greedy else params.top_k,
        top_p=0.0 if greedy or params.top_p >= 1 else params.top_p,
        return_log_probs=True,
        skip_prompt_log_probs=True,
        num_tokens_to_generate=params.max_tokens,
        termination_id=-1 if params.ignore_eos or eos_id is None else eos_id,
        stop_words=list(params.stop) or None,
    )
