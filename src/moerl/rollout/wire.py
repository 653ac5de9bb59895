"""Generation requests and replies on the wire, for each rollout engine.

The RL loop needs, per sample: the prompt's token ids, the generated token ids,
one logprob per generated token, and the finish reason. Each engine returns them
differently:

- moerl (`rl.rollout.server`): `/v1/completions` with our extensions on each
  choice (`prompt_token_ids`, `token_ids`, `token_logprobs`) and the reply's
  `weight_version`.
- vLLM: `/v1/completions` with `logprobs` (the sampled token's logprob in
  `choices[i].logprobs.token_logprobs`), `return_token_ids` (vLLM >= 0.10.2 adds
  `token_ids` and `prompt_token_ids` to each choice) and `return_tokens_as_token_ids`
  (`logprobs.tokens` become "token_id:123" strings, which is how ids are read from
  older servers). Choices come prompt-major: index i * n + j. vLLM's reply names
  no weight version: the client's last pushed version is reported instead.
  `top_k` "off" is sent as -1, which old and new vLLM accept (0 only newer ones).
- SGLang: the native `/generate` (it pairs every logprob with its token id) with
  `return_logprob`; each output is `{"text", "output_ids", "meta_info"}` where
  `meta_info.output_token_logprobs` is a list of `(logprob, token_id, text|None)`,
  `meta_info.finish_reason` is `{"type": "stop"|"length"|"abort", ...}` and
  `meta_info.weight_version` is the string given with the last
  `/update_weights_from_disk`. Every prompt is sent n times with n=1 (outputs come
  back in input order) because SGLang's `sampling_seed` is per request: n copies of
  one seeded request would be identical. Text prompts ask for
  `logprob_start_len: 0`, whose `input_token_logprobs` carry the prompt's ids.

A finish reason "abort" (SGLang aborts requests around a weight update; vLLM
answers "abort" for requests cut off server-side) raises `EngineAborted`, which
the client retries elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moerl.rollout.backends import Engine
from moerl.rollout.types import (
    FinishReason,
    RoutedExperts,
    Sample,
    SamplingParams,
    SpeculationStats,
)

Prompt = str | Sequence[int]
_TOKEN_ID_PREFIX = "token_id:"


class EngineAborted(RuntimeError):
    """The engine aborted a request (around a weight update): ask again."""


class ReplyError(RuntimeError):
    """A reply that does not hold what the request asked for; the message says which field."""


@dataclass(frozen=True)
class GenerationCall:
    """One generation POST, and what is needed to read its reply."""

    path: str
    body: dict[str, Any]
    prompts: tuple[Prompt, ...]
    n: int

    @property
    def expected(self) -> int:
        return len(self.prompts) * self.n


def generation_call(engine: Engine, prompts: Sequence[Prompt], sampling: SamplingParams,
                    seed: int | None, model: str | None = None) -> GenerationCall:
    """The request for `prompts` (n samples each); prompt j is seeded from `seed + j`."""
    chunk = tuple(p if isinstance(p, str) else list(p) for p in prompts)
    if sampling.return_routed_experts and engine != "moerl":
        raise ValueError(f"return_routed_experts: rollout.engine={engine} does not return the "
                         "experts it routed to; routing replay needs rollout.engine=moerl")
    if engine == "sglang":
        return GenerationCall("/generate", _sglang_body(chunk, sampling, seed), chunk, sampling.n)
    body: dict[str, Any] = {
        "prompt": list(chunk), "n": sampling.n, "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature, "top_p": sampling.top_p,
        "stop": list(sampling.stop) or None, "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos, "seed": seed, "logprobs": 1,
    }
    if engine == "vllm":
        body.update(top_k=sampling.top_k or -1, return_token_ids=True,
                    return_tokens_as_token_ids=True)
    else:
        body.update(top_k=sampling.top_k, logprob_mode=sampling.logprob_mode)
        if sampling.return_routed_experts:
            body["return_routed_experts"] = True
    if model:
        body["model"] = model
    return GenerationCall("/v1/completions", body, chunk, sampling.n)


def _sglang_body(chunk: tuple[Prompt, ...], sampling: SamplingParams, seed: int | None
                 ) -> dict[str, Any]:
    texts = [isinstance(p, str) for p in chunk]
    if any(texts) and not all(texts):
        raise ValueError("rollout.engine=sglang: one call cannot mix text and token-id prompts; "
                         "pass prompts of one kind to `generate`")
    params = []
    for j in range(len(chunk)):
        for i in range(sampling.n):
            one: dict[str, Any] = {
                "max_new_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "top_k": sampling.top_k or -1, "n": 1,
                "stop": list(sampling.stop), "stop_token_ids": list(sampling.stop_token_ids),
                "ignore_eos": sampling.ignore_eos,
            }
            if seed is not None:  # distinct per sample, the same for the same (prompt, sample)
                one["sampling_seed"] = ((seed + j) * 1_000_003 + i) % (1 << 31)
            params.append(one)
    repeated = [p for p in chunk for _ in range(sampling.n)]  # prompt-major, as parsed
    body: dict[str, Any] = {"sampling_params": params, "return_logprob": True,
                            "return_text_in_logprobs": False}
    if all(texts):
        body.update(text=repeated, logprob_start_len=0)
    else:
        body.update(input_ids=repeated, logprob_start_len=-1)
    return body


def parse_generation(engine: Engine, call: GenerationCall, reply: Any, version: int
                     ) -> list[Sample]:
    """Samples (prompt-major) from an engine's reply to `call`. `version`: reported
    when the reply names none (vLLM)."""
    if engine == "sglang":
        return _parse_sglang(call, reply, version)
    if engine == "vllm":
        return _parse_vllm(call, reply, version)
    return parse_samples(reply)


def parse_samples(reply: dict[str, Any]) -> list[Sample]:
    """Samples from our own server's completions reply."""
    version = int(reply.get("weight_version", -1))
    samples = []
    for choice in sorted(reply["choices"], key=lambda c: c["index"]):
        logprobs = choice.get("token_logprobs")
        if logprobs is None and choice.get("logprobs"):
            logprobs = choice["logprobs"]["token_logprobs"]
        samples.append(Sample(
            prompt_token_ids=tuple(choice.get("prompt_token_ids") or ()),
            token_ids=tuple(choice.get("token_ids") or ()),
            logprobs=tuple(logprobs or ()),
            finish_reason=_finish(choice.get("finish_reason"), "moerl"),
            weight_version=int(choice.get("weight_version", version)),
            text=choice.get("text", ""),
            speculation=SpeculationStats(**choice["speculation"]) if choice.get("speculation")
            else None,
            routed_experts=RoutedExperts.from_json(choice["routed_experts"])
            if choice.get("routed_experts") else None,
            token_versions=tuple(v for v, count in choice["token_versions"]
                                 for _ in range(count))
            if choice.get("token_versions") else None,
        ))
    return samples


def _finish(reason: Any, engine: str) -> FinishReason:
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        message = reason.get("message", "") if isinstance(reason, dict) else ""
        raise EngineAborted(f"{engine} aborted the request {message}".rstrip())
    return "length" if kind == "length" else "stop"


def token_id(token: str) -> int:
    """123 from vLLM's "token_id:123" (what `return_tokens_as_token_ids` returns)."""
    if not token.startswith(_TOKEN_ID_PREFIX):
        raise ReplyError(f"vllm reply: logprobs.tokens holds {token!r}, not 'token_id:<id>'; "
                         "the server ignored return_tokens_as_token_ids (a vLLM older than "
                         "that option)")
    return int(token[len(_TOKEN_ID_PREFIX):])


def _parse_vllm(call: GenerationCall, reply: dict[str, Any], version: int) -> list[Sample]:
    samples = []
    for choice in sorted(reply["choices"], key=lambda c: c["index"]):
        where = f"vllm reply: choices[{choice['index']}]"
        finish = _finish(choice.get("finish_reason"), "vllm")
        logprobs = choice.get("logprobs") or {}
        if "token_logprobs" not in logprobs:
            raise ReplyError(f"{where}.logprobs is missing; the request sets `logprobs`")
        values = [float(x) for x in logprobs["token_logprobs"]]
        ids = choice.get("token_ids")
        if ids is None:
            ids = [token_id(t) for t in logprobs.get("tokens", [])]
        if len(ids) != len(values):
            raise ReplyError(f"{where}: {len(ids)} token ids but {len(values)} token_logprobs")
        prompt = choice.get("prompt_token_ids")
        if prompt is None:
            asked = call.prompts[choice["index"] // call.n]
            prompt = [] if isinstance(asked, str) else asked  # text prompts: ids unknown
        samples.append(Sample(prompt_token_ids=tuple(prompt), token_ids=tuple(ids),
                              logprobs=tuple(values), finish_reason=finish,
                              weight_version=version, text=choice.get("text", "")))
    return samples


def _parse_sglang(call: GenerationCall, reply: Any, version: int) -> list[Sample]:
    outputs = reply if isinstance(reply, list) else [reply]
    samples = []
    for k, out in enumerate(outputs):
        where = f"sglang reply: [{k}].meta_info"
        meta = out.get("meta_info") or {}
        finish = _finish(meta.get("finish_reason"), "sglang")
        if "output_token_logprobs" not in meta:
            raise ReplyError(f"{where}.output_token_logprobs is missing; the request sets "
                             "return_logprob")
        triples = meta["output_token_logprobs"]
        ids = [int(t[1]) for t in triples]  # aligned with the logprobs, unlike output_ids
        asked = call.prompts[k // call.n] if k // call.n < len(call.prompts) else ""
        if isinstance(asked, str):  # asked with logprob_start_len 0: the prompt's ids
            prompt = [int(t[1]) for t in meta.get("input_token_logprobs") or ()]
        else:
            prompt = list(asked)
        served = str(meta.get("weight_version", ""))
        samples.append(Sample(
            prompt_token_ids=tuple(prompt), token_ids=tuple(ids),
            logprobs=tuple(float(t[0]) for t in triples), finish_reason=finish,
            weight_version=int(served) if served.isdigit() else version,
            text=out.get("text", "")))
    return samples
