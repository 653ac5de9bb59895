"""One prompt's group of generations, whatever produced it, as the loop reads it.

A single-shot prompt's samples scored by the reward servers (`scoring.ScoredGroup`) and
a terminal task's episodes graded by its check (`agent_collect.EpisodeGroup`) are both a
`Group`: the loop filters, counts and trains on them through this protocol alone, so one
collect path serves prompts, agent tasks and mixtures of both.

Metrics over groups (`group_metrics`), from each group's `outcomes`:

    reward/mean               mean reward of the scored generations (after shaping)
    reward/pass_rate          share of scored generations with reward 1
    reward/infra_errors       generations without a reward because the system failed
    reward/compile_rate       share that compiled, where the reward function says
    rollout/response_length   mean length in model tokens (also _max and _p50)
    rollout/stop_fraction     share that ended by themselves (not cut at a limit)
    rollout/informative_groups  groups whose rewards differ (they carry a gradient)
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from moerl.agent.trajectory import Trajectory
from moerl.data.prompts import PromptRecord
from moerl.data.rl_batch import RLSample
from moerl.rl.config import RLConfig
from moerl.rollout.types import Sample


@dataclass(frozen=True)
class Outcome:
    """One generation of a group, for the metrics."""

    reward: float | None
    """The reward as scored (before shaping); None exactly for infra failures."""
    length: int
    """Model tokens generated."""
    truncated: bool
    """Cut at a token limit (an episode: cut, or not submitted)."""
    stopped: bool
    """Ended by itself: a stop token (an episode: submitted)."""
    seconds: float | None = None
    """The reward function's time on the server, where one scored it."""
    compile_ok: bool | None = None


class Group(Protocol):
    """One prompt's generations: rewards, whether they carry a gradient, samples."""

    @property
    def record(self) -> PromptRecord: ...

    @property
    def samples(self) -> Sequence[Sample]:
        """The engine's samples of a single-shot prompt (none for episodes)."""
        ...

    @property
    def trajectories(self) -> Sequence[Trajectory]:
        """A terminal task's episodes (none for a single-shot prompt)."""
        ...

    def rewards(self, cfg: RLConfig | None = None) -> list[float | None]:
        """Each generation's reward (shaped by `cfg` where given); None for an infra
        failure, which is never trained on."""
        ...

    @property
    def informative(self) -> bool:
        """Whether the rewards differ: only then do group-relative advantages move it."""
        ...

    def outcomes(self) -> list[Outcome]: ...

    def to_samples(self, cfg: RLConfig, group_id: int) -> list[RLSample]:
        """The training samples with their advantages (none when fewer than two
        generations were scored)."""
        ...


def has_spread(rewards: Sequence[float | None]) -> bool:
    """Whether a group's rewards differ (at least two scored, not all equal): only then
    do group-relative advantages give it a gradient."""
    valid = [r for r in rewards if r is not None]
    return len(valid) >= 2 and max(valid) > min(valid)


def mean_or_zero(values: Sequence[float]) -> float:
    """The mean of a metric's values; 0 for none (a step without such generations)."""
    return statistics.fmean(values) if values else 0.0


def group_metrics(groups: Sequence[Group], cfg: RLConfig | None = None) -> dict[str, float]:
    """The series of the module docstring over `groups`."""
    outcomes = [o for g in groups for o in g.outcomes()]
    shaped = [r for g in groups for r in g.rewards(cfg) if r is not None]
    scored = [o.reward for o in outcomes if o.reward is not None]
    lengths = [o.length for o in outcomes]
    metrics = {
        "reward/mean": mean_or_zero(shaped),
        "reward/pass_rate": mean_or_zero([r == 1.0 for r in scored]),
        "reward/infra_errors": float(len(outcomes) - len(scored)),
        "rollout/response_length": mean_or_zero(lengths),
        "rollout/response_length_max": float(max(lengths, default=0)),
        "rollout/response_length_p50": statistics.median(lengths) if lengths else 0.0,
        "rollout/stop_fraction": mean_or_zero([o.stopped for o in outcomes]),
        "rollout/informative_groups": float(sum(g.informative for g in groups)),
    }
    compiled = [o.compile_ok for o in outcomes if o.compile_ok is not None]
    if compiled:
        metrics["reward/compile_rate"] = mean_or_zero(compiled)
    return metrics
