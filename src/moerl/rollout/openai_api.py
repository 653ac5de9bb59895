"""The OpenAI `/v1/completions` body and response, and their mapping to engine types.

Extensions to the OpenAI shape, per choice: `prompt_token_ids`, `token_ids`,
`token_logprobs` (one per token id, the logprob convention of `types`), and at
the top level `weight_version`. Request extensions: `top_k`, `stop_token_ids`,
`ignore_eos`, `logprob_mode`. With several prompts and a `seed`, prompt j is
sampled as a one-prompt request with seed `seed + j` would be.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from moerl.data.tokenizer import Tokenizer
from moerl.rollout.types import (
    GenerationRequest,
    LogprobMode,
    RequestError,
    Sample,
    SamplingParams,
)

Prompt = str | list[int]


class CompletionBody(BaseModel):
    """The fields of OpenAI's completions request that this server reads; others are ignored."""

    model: str | None = None
    prompt: str | list[int] | list[Prompt]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off (vLLM spells "off" -1)
    n: int = Field(1, ge=1, le=1024)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    stream: bool = False
    ignore_eos: bool = False
    logprob_mode: LogprobMode | None = None
    return_routed_experts: bool = False  # moerl: per position, the experts each MoE layer chose


class UpdateBody(BaseModel):
    path: str
    version: int


class GroupBody(BaseModel):
    """`rollout.weight_group.GroupSpec`: how this server's ranks join the trainer's group."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "moerl-weights"
    backend: str = "gloo"
    timeout_s: float = Field(600.0, gt=0)


class ManifestBody(BaseModel):
    """`rollout.weight_group.Manifest`: the version the joined group is about to carry."""

    version: int
    group_name: str
    buffer_bytes: int = Field(128 << 20, ge=1 << 10)


def _prompts(body: CompletionBody, tokenizer: Tokenizer) -> list[list[int]]:
    raw = body.prompt
    items: list[Prompt]
    if isinstance(raw, str):
        items = [raw]
    else:
        ids = [t for t in raw if isinstance(t, int)]
        items = [t for t in raw if not isinstance(t, int)]
        if ids and not items:
            items = [ids]  # one prompt given as token ids
        elif ids:
            raise RequestError("prompt: do not mix token ids with prompts in one list")
    if not items:
        raise RequestError("prompt: give a string, a list of token ids, or a list of either")
    prompts = []
    for j, item in enumerate(items):
        ids = tokenizer.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise RequestError(f"prompt[{j}] is empty")
        prompts.append(ids)
    return prompts


def to_requests(body: CompletionBody, tokenizer: Tokenizer,
                default_mode: LogprobMode) -> list[GenerationRequest]:
    """One engine request per prompt; `RequestError` names what is wrong."""
    if body.stream:
        raise RequestError("stream: streaming is not supported; send stream=false")
    if body.echo:
        raise RequestError("echo: not supported; the prompt comes back as prompt_token_ids")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    requests = []
    for j, ids in enumerate(_prompts(body, tokenizer)):
        sampling = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            n=body.n,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            seed=None if body.seed is None else body.seed + j,
            logprob_mode=body.logprob_mode or default_mode,
            return_routed_experts=body.return_routed_experts,
        )
        requests.append(GenerationRequest(tuple(ids), sampling))
    return requests


def _choice(index: int, sample: Sample, want_logprobs: bool,
            tokenizer: Tokenizer) -> dict[str, Any]:
    logprobs = None
    if want_logprobs:
        pieces = [tokenizer.decode([t]) for t in sample.token_ids]
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        logprobs = {"tokens": pieces, "token_logprobs": list(sample.logprobs),
                    "top_logprobs": None, "text_offset": offsets}
    return {
        "index": index,
        "text": sample.text,
        "logprobs": logprobs,
        "finish_reason": sample.finish_reason,
        "prompt_token_ids": list(sample.prompt_token_ids),
        "token_ids": list(sample.token_ids),
        "token_logprobs": list(sample.logprobs),
        "speculation": dataclasses.asdict(sample.speculation) if sample.speculation else None,
        "routed_experts": sample.routed_experts.to_json() if sample.routed_experts else None,
        **({"weight_version": sample.weight_version,
            "token_versions": run_lengths(sample.token_versions)}
           if sample.token_versions is not None else {}),
    }


def run_lengths(values: Sequence[int]) -> list[list[int]]:
    """[[value, count], ...] of consecutive equal values: a sample's token versions
    change at most once per weight update."""
    out: list[list[int]] = []
    for value in values:
        if out and out[-1][0] == value:
            out[-1][1] += 1
        else:
            out.append([value, 1])
    return out


def to_response(groups: list[list[Sample]], body: CompletionBody, model: str,
                tokenizer: Tokenizer) -> dict[str, Any]:
    """OpenAI's response, choices prompt-major (prompt j, sample i -> index j * n + i)."""
    samples = [s for group in groups for s in group]
    versions = {s.weight_version for s in samples}
    partial = any(s.token_versions is not None for s in samples)
    assert partial or len(versions) == 1, f"one response mixes weight versions {versions}"
    prompt_tokens = sum(len(g[0].prompt_token_ids) for g in groups)
    completion_tokens = sum(len(s.token_ids) for s in samples)
    kind: Literal["text_completion"] = "text_completion"
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(i, s, body.logprobs is not None, tokenizer)
                    for i, s in enumerate(samples)],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "weight_version": min(versions),  # partial rollouts: each choice has its own
    }
