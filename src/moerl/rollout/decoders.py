"""Which decoder a `MegatronEngine` runs, and the continuous one built to its settings."""

from __future__ import annotations

import logging
from typing import Literal

import torch
from megatron.core.models.gpt import GPTModel

from moerl.rollout.continuous_decode import ContinuousDecoder, ContinuousOptions
from moerl.rollout.dynamic_decode import dynamic_missing
from moerl.rollout.options import EngineOptions
from moerl.rollout.paged_cache import CacheSpec, PagedKVCache
from moerl.rollout.routing_capture import RoutingCapture
from moerl.rollout.serving_model import ServingUnavailable, check_servable
from moerl.rollout.static_decode import AgreeSamples, Detokenize

log = logging.getLogger(__name__)

Resolved = Literal["continuous", "static", "dynamic"]
_MAX_ROWS = 1024  # sequences at once when max_batch is 0 (and the cache holds them)


def _continuous_unavailable(model: GPTModel) -> str | None:
    try:
        check_servable(model)
    except ServingUnavailable as err:
        return str(err)
    return None


def wants_dynamic(options: EngineOptions, pipeline_stages: int = 1) -> bool:
    """Whether `options` will run Megatron's dynamic engine here (asked before the model
    is built: its CUDA graphs need the model built for them)."""
    if options.speculative.enabled or options.partial_rollouts or pipeline_stages > 1:
        return False
    return options.backend == "dynamic" or (options.backend == "auto"
                                            and dynamic_missing() is None)


def resolve_backend(options: EngineOptions, model: GPTModel, across_ranks: bool) -> Resolved:
    """The decoder for `options.backend` on this model and machine; a clear error for a
    combination that cannot run."""
    requested = options.backend
    if options.speculative.enabled:
        if requested in ("continuous", "dynamic") or across_ranks:
            raise ValueError("speculative decoding runs on the static backend of a one-rank "
                             "server; set backend='static' (or auto) and one rank, or "
                             "speculative.mode='none'")
        return "static"
    why_not = _continuous_unavailable(model)
    if requested == "auto":
        missing = dynamic_missing()
        if missing is None and not options.partial_rollouts and model.pre_process \
                and model.post_process:
            return "dynamic"
        if why_not is None:
            log.info("rollout backend: continuous batching (dynamic engine: %s)", missing)
            return "continuous"
        log.info("rollout backend: static decoder (%s)", why_not)
        return "static"
    if requested == "continuous" and why_not is not None:
        raise ValueError(why_not)
    if requested == "dynamic" and options.partial_rollouts:
        raise ValueError("the dynamic backend takes weight updates between generations "
                         "only; partial rollouts run on backend='continuous'")
    if requested == "static" and options.partial_rollouts and across_ranks:
        raise ValueError("partial rollouts across ranks run on the continuous backend; "
                         "set backend='continuous' (or auto)")
    return requested


def default_cache_bytes(device: torch.device) -> float:
    """1 GiB on a CPU; half the free memory of a GPU (after the weights)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / 2
    return float(2**30)


def build_continuous(model: GPTModel, eos_id: int | None, detokenize: Detokenize,
                     options: EngineOptions, capture: RoutingCapture | None,
                     agree: AgreeSamples | None) -> ContinuousDecoder:
    """A continuous decoder over a paged cache of `options.kv_cache_gb` on this rank."""
    param = next(model.parameters())
    budget = options.kv_cache_gb * 2**30 or default_cache_bytes(param.device)
    cache = PagedKVCache.sized(CacheSpec.of_model(model), len(model.decoder.layers), budget,
                               options.block_size, param.dtype, param.device)
    rows = options.max_batch or min(_MAX_ROWS, cache.pool.usable)
    settings = ContinuousOptions(step_tokens=options.prefill_chunk, max_rows=rows,
                                 block_size=options.block_size)
    log.info("continuous engine: KV cache of %.2f GiB, %d tokens (%d bytes a token), up to "
             "%d sequences", cache.nbytes / 2**30, cache.token_capacity,
             cache.bytes_per_token, rows)
    return ContinuousDecoder(model, cache, eos_id, detokenize, settings, agree, capture)
