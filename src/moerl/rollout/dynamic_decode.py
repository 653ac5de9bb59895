"""Decoding on Megatron's dynamic inference engine: paged KV cache, continuous batching (GPU).

Selected at run time when a GPU and flash attention are present; on CPU the
static path (`static_decode`) runs instead, and asking for this one there fails
with `DynamicUnavailable` naming what is missing. It cannot run on the CPU machine
the tests use; `scripts/gpu_smoke.sh` is where it is exercised.

Differences from the static path, all from the engine itself:
- sampling uses one generator per engine (`inference_sampling_seed`), so a
  request's `seed` does not make it reproducible on its own; the engine is
  re-seeded from the first request's seed at every call;
- the logprob mode is fixed per engine (`InferenceConfig.logprobs_mode`:
  "raw_logprobs" is our "policy"; "processed_logprobs" follows the engine's
  own post-filter definition).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from moerl.rollout.static_decode import DecodeRow, Detokenize, check_stop
from moerl.rollout.types import LogprobMode, RequestError

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
    """Runs `DecodeRow`s through one long-lived `DynamicInferenceEngine`."""

    def __init__(self, model: GPTModel, eos_id: int | None, detokenize: Detokenize,
                 encode: Any, max_batch: int, max_sequence_length: int,
                 logprob_mode: LogprobMode = "policy", buffer_size_gb: float = 8.0) -> None:
        missing = dynamic_missing()
        if missing is not None:
            raise DynamicUnavailable(
                f"rollout backend 'dynamic' needs a GPU with flash attention, but {missing}; "
                "use --backend static (or auto)"
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
            buffer_size_gb=buffer_size_gb,
            materialize_only_last_token_logits=True,
            logprobs_mode="raw_logprobs" if logprob_mode == "policy" else "processed_logprobs",
        )
        context = DynamicInferenceContext(model.config, config)
        wrapper = GPTInferenceWrapper(model, context)
        tokenizer = _EngineTokenizer(eos_id, detokenize, encode)
        self.controller = TextGenerationController(wrapper, tokenizer)
        self.engine = DynamicInferenceEngine(self.controller, context)
        self._next_id = 0

    def decode(self, rows: list[DecodeRow]) -> None:
        from megatron.core.inference.sampling_params import SamplingParams as MSampling

        if rows and rows[0].sampling.params.seed is not None:
            self.controller.sampling_rng.manual_seed(rows[0].sampling.params.seed)
        ids = {}
        for row in rows:
            params = row.sampling.params
            if params.logprob_mode != self.logprob_mode:
                raise RequestError(
                    f"logprob_mode {params.logprob_mode!r}: this dynamic-engine server serves "
                    f"{self.logprob_mode!r} only"
                )
            greedy = params.temperature == 0
            sampling = MSampling(
                temperature=1.0 if greedy else params.temperature,
                top_k=1 if greedy else params.top_k,
                top_p=0.0 if greedy or params.top_p >= 1 else params.top_p,
                return_log_probs=True,
                skip_prompt_log_probs=True,
                num_tokens_to_generate=params.max_tokens,
                termination_id=-1 if params.ignore_eos or self.eos_id is None else self.eos_id,
                stop_words=list(params.stop) or None,
            )
            self._next_id += 1
            ids[self._next_id] = row
            self.engine.add_request(self._next_id, list(row.prompt), sampling)
        while self.engine.has_unfinished_requests():
            result = self.engine.step_modern()
            for record in result["finished_request_records"]:
                done = record.merge()
                self._finish(ids[done.request_id], done)

    def _finish(self, row: DecodeRow, done: Any) -> None:
        tokens = [int(t) for t in done.generated_tokens]
        logprobs = [float(x) for x in done.generated_log_probs]
        # Replay our stop rules over the engine's tokens so both paths agree on the
        # cut, the finish reason and the text (stop token ids are ours, not the engine's).
        for token, logprob in zip(tokens, logprobs, strict=False):
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            check_stop(row, self.eos_id, self.detokenize)
            if row.finish_reason is not None:
                return
        row.finish_reason = "length"
        row.text = self.detokenize(row.token_ids)
