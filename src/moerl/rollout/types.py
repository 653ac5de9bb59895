"""What a rollout engine is asked for and what it answers, shared by engine, server and client.

Logprob convention (`LogprobMode`):

- ``"policy"`` (default): log pi(token | prefix) at temperature 1, from the
  unmodified logits, whatever temperature / top-k / top-p were used to *choose*
  the token. This is what the trainer recomputes with a plain forward pass and
  log-softmax, so the importance ratio pi_new / pi_old of PPO-style losses and the
  engine-vs-trainer gap are measured on the same distribution. It is also vLLM's
  and Megatron's dynamic engine's default ("raw logprobs").
- ``"sampling"``: log of the distribution the token was drawn from before
  truncation, log_softmax(logits / temperature) (temperature 0 counts as 1). Use it
  only when the trainer also divides its logits by the sampling temperature.

In neither mode are top-k / top-p renormalised into the logprob: truncation is a
choice of the sampler, not of the policy.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]
LogprobMode = Literal["policy", "sampling"]
LOGPROB_MODES: tuple[str, ...] = ("policy", "sampling")


class RequestError(ValueError):
    """A request that cannot be served as asked; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt's completions.

    `temperature == 0` is greedy decoding. `top_k == 0` and `top_p == 1` switch
    those filters off. The EOS token always stops unless `ignore_eos`. With a
    `seed`, sample i of the request draws from its own generator seeded by
    (seed, i), so the same request gives the same tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprob_mode: LogprobMode = "policy"
    return_routed_experts: bool = False
    """Also return, per token the engine ran, the experts each MoE layer chose
    (`Sample.routed_experts`), for the trainer to replay."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.n < 1:
            raise RequestError(f"n must be >= 1, got {self.n}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")
        if self.logprob_mode not in LOGPROB_MODES:
            raise RequestError(f"logprob_mode must be one of {LOGPROB_MODES}")


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (token ids) and how to sample its `sampling.n` completions."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise RequestError("prompt is empty; give at least one token")


@dataclass(frozen=True)
class SpeculationStats:
    """How speculative decoding went for one sample (see `rl.rollout.speculative`).

    `drafted` draft tokens were scored by the policy and `accepted` of them kept;
    `steps` policy forward steps emitted this sample's `tokens` generated tokens
    (each step emits its accepted drafts plus one token drawn by the policy).
    """

    drafted: int
    accepted: int
    steps: int
    tokens: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per policy forward step (1.0 = no gain from speculation)."""
        return self.tokens / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class Sample:
    """One completion.

    `token_ids` include the token that stopped generation (EOS or a stop token id,
    or the token that completed a stop string), so the trainer sees it;
    `logprobs[i]` belongs to `token_ids[i]` (see the module docstring for which
    distribution). `text` is the decoded completion, cut before a matched stop string.
    """

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    weight_version: int
    text: str = ""
    speculation: SpeculationStats | None = None  # None when decoded without speculation
    routed_experts: RoutedExperts | None = None
    """With `return_routed_experts`: the experts of every position the engine ran."""
    token_versions: tuple[int, ...] | None = None
    """Partial rollouts: the weight version that sampled each token (a weight update
    can land between two decode steps); `weight_version` is the first token's. None:
    every token is `weight_version`'s."""

    @property
    def versions(self) -> tuple[int, ...]:
        """The weight version of every generated token."""
        return self.token_versions or (self.weight_version,) * len(self.token_ids)


@dataclass(frozen=True)
class RoutedExperts:
    """The experts an engine's MoE layers chose, per position of one sequence.

    `shape` is (MoE layers, positions, top-k), layers in order, positions those the
    engine ran: the prompt and every generated token but the last (which it never fed
    back). `ids` holds the expert ids row-major, one byte each (two, little-endian,
    past 256 experts). On the wire (`to_json`) they are zlib-compressed and base64'd:
    consecutive tokens often share experts, and an id is one byte, not a JSON number.
    """

    shape: tuple[int, int, int]
    ids: bytes

    @property
    def width(self) -> int:
        """Bytes per id."""
        return len(self.ids) // max(1, self.shape[0] * self.shape[1] * self.shape[2])

    def to_json(self) -> dict[str, object]:
        return {"shape": list(self.shape), "width": self.width,
                "data": base64.b64encode(zlib.compress(self.ids, 1)).decode("ascii")}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> RoutedExperts:
        shape = data.get("shape")
        payload = data.get("data")
        if not (isinstance(shape, list) and len(shape) == 3 and isinstance(payload, str)):
            raise ValueError("routed_experts: expected {shape: [layers, positions, topk], "
                             "width, data}")
        layers, positions, topk = (int(x) for x in shape)
        ids = zlib.decompress(base64.b64decode(payload))
        width = data.get("width", 1)
        if len(ids) != layers * positions * topk * int(str(width)):
            raise ValueError(f"routed_experts: {len(ids)} bytes do not hold shape {shape}")
        return cls((layers, positions, topk), ids)
