"""An episode as token ids, the context-truncation policy, and the training record.

An episode is `prompt_ids` (instructions, tools, task statement, first observation)
followed by alternating segments: the model's sampled tokens exactly as the engine
returned them (never re-tokenized, so their rollout logprobs stay aligned), then the
environment's observation encoded by the tokenizer. Only model tokens carry loss.

Context truncation (what the model sees when the episode outgrows its context): the
prompt is always kept (the task statement), then a marker saying how many turns were
left out, then the newest whole turns that fit; the latest turn (the current state) is
always kept, and if even that does not fit the episode ends. Model turns generated from
such a shortened context are flagged: in the full training sequence their prefix is not
the context they were sampled from, so by default `to_record` gives them no loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from moerl.data.rl_batch import RLSample

EpisodeStatus = Literal[
    "submitted",  # the model called submit
    "max_turns",
    "retries_exhausted",  # too many failed actions in a row
    "context_exhausted",  # the task plus the latest turn no longer fit the context
    "episode_length",  # the per-episode token limit was reached
    "infra_failure",  # the environment or the rollout service failed: never scored
]


@dataclass
class Segment:
    role: Literal["model", "observation"]
    token_ids: list[int]
    logprobs: list[float] | None = None
    """Rollout logprobs, one per token; model segments only."""
    truncated: bool = False
    """Model: stopped at the per-turn max_tokens. Observation: cut to its token limit."""
    context_truncated: bool = False
    """Model: sampled from a context with older turns left out."""
    weight_version: int = -1

    def __post_init__(self) -> None:
        if self.role == "model" and (self.logprobs is None
                                     or len(self.logprobs) != len(self.token_ids)):  # fmt: skip
            raise ValueError("a model segment needs one logprob per token")


@dataclass(frozen=True)
class AgentSample:
    """One training sequence: prompt_ids + completion_ids.

    completion_ids: [T]; loss_mask: [T], 1 on the model's own tokens; rollout_logprobs:
    [T], the engine's logprob for loss tokens and 0.0 where masked; reward: the verifier's
    reward plus the sum of per-step shaping.
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    reward: float
    task_id: str = ""
    weight_version: int = -1
    """The oldest weight version among the loss tokens (for staleness bounds)."""
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_rl_sample(self, advantage: float = 0.0, group_id: int = 0) -> RLSample:
        """The RL loop's sample type (moerl.data.rl_batch): same ids, mask and logprobs as
        (C,) tensors; the advantage is computed later over the group's rewards."""
        import torch

        from moerl.data.rl_batch import RLSample

        if not self.completion_ids:
            raise ValueError(f"episode {self.task_id} has no completion tokens to train on")
        return RLSample(
            prompt_ids=torch.tensor(self.prompt_ids, dtype=torch.int64),
            completion_ids=torch.tensor(self.completion_ids, dtype=torch.int64),
            advantage=advantage,
            rollout_logprobs=torch.tensor(self.rollout_logprobs, dtype=torch.float32),
            loss_mask=torch.tensor(self.loss_mask, dtype=torch.float32),
            reward=self.reward,
            weight_version=self.weight_version,
            group_id=group_id,
        )


@dataclass
class Trajectory:
    task_id: str
    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    status: EpisodeStatus = "max_turns"
    reward: float | None = None
    """The verifier's reward; None exactly for infra failures."""
    step_rewards: list[float] = field(default_factory=list)
    """Optional shaping, one per model turn."""
    truncations: list[str] = field(default_factory=list)
    """Every cut made, in words: which turn, what, how much."""
    faults: list[str] = field(default_factory=list)
    """Environment faults seen (each recovered, unless the episode is an infra failure)."""
    infra_error: str | None = None
    verify_details: dict[str, Any] = field(default_factory=dict)

    @property
    def is_infra_failure(self) -> bool:
        return self.status == "infra_failure"

    @property
    def env_faults(self) -> int:
        return len(self.faults)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + sum(len(s.token_ids) for s in self.segments)

    @property
    def model_turns(self) -> int:
        return sum(s.role == "model" for s in self.segments)

    def to_record(self, *, loss_on_truncated_context: bool = False) -> AgentSample:
        """The training record. Infra failures have no reward and must not be trained on
        as model failures: they raise."""
        if self.reward is None or self.is_infra_failure:
            raise ValueError(f"episode {self.task_id} is an infra failure ({self.infra_error}); "
                             "it has no reward and is not a training sample")  # fmt: skip
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for seg in self.segments:
            ids += seg.token_ids
            trained = seg.role == "model" and (loss_on_truncated_context
                                               or not seg.context_truncated)  # fmt: skip
            mask += [int(trained)] * len(seg.token_ids)
            if trained and seg.logprobs is not None:
                logprobs += seg.logprobs
                versions.append(seg.weight_version)
            else:
                logprobs += [0.0] * len(seg.token_ids)
        return AgentSample(
            prompt_ids=tuple(self.prompt_ids), completion_ids=tuple(ids),
            loss_mask=tuple(mask), rollout_logprobs=tuple(logprobs),
            reward=self.reward + sum(self.step_rewards), task_id=self.task_id,
            weight_version=min(versions) if versions else -1,
            metadata={"status": self.status, "truncations": list(self.truncations),
                      "env_faults": self.env_faults, "turns": self.model_turns},
        )  # fmt: skip


def cut_tokens(ids: list[int], limit: int, marker: list[int]) -> tuple[list[int], bool]:
    """`ids` within `limit` tokens: head + marker + tail (the tail usually holds the
    error). Returns (ids, was_cut)."""
    if len(ids) <= limit:
        return ids, False
    if limit <= len(marker):
        return ids[:limit], True
    keep = limit - len(marker)
    head = keep // 2
    return ids[:head] + marker + ids[len(ids) - (keep - head) :], True


def fit_context(prompt: list[int], segments: Sequence[Segment], budget: int,
                omitted: Callable[[int], list[int]]) -> tuple[list[int], int] | None:  # fmt: skip
    """The context for the next model turn within `budget` tokens.

    Segments come in turns (a model segment and the observation after it). Returns
    (ids, turns left out), or None when the prompt, the marker and the latest turn do not
    fit together. `omitted(k)` gives the marker tokens for k left-out turns.
    """
    turns: list[list[int]] = []
    for seg in segments:
        if seg.role == "model" or not turns:
            turns.append([])
        turns[-1] += seg.token_ids
    total = len(prompt) + sum(len(t) for t in turns)
    if total <= budget:
        return [*prompt, *(i for t in turns for i in t)], 0
    kept: list[list[int]] = []
    used = len(prompt)
    for turn in reversed(turns):
        dropped = len(turns) - len(kept) - 1
        if kept and used + len(turn) + len(omitted(dropped)) > budget:
            break
        kept.insert(0, turn)
        used += len(turn)
    dropped = len(turns) - len(kept)
    ids = [*prompt, *omitted(dropped), *(i for t in kept for i in t)]
    return (ids, dropped) if len(ids) <= budget else None
