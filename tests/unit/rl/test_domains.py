"""A round over a mixture: each domain sampled with its own settings and group size,
terminal prompts run as episodes, per-domain metrics and held-out evaluation."""

from __future__ import annotations

from typing import Any, cast

from moerl.agent.trajectory import Segment, Trajectory
from moerl.data.domain_config import DomainConfig, DomainSampling
from moerl.data.prompts import PromptRecord
from moerl.rewards.client import ScoreItem, ScoreReport
from moerl.rewards.protocol import RewardResult
from moerl.rl.agent_collect import EPISODE, AgentCollector, EpisodeGroup
from moerl.rl.config import AgentTasksConfig, RLConfig
from moerl.rl.domains import Generation, domain_metrics, domain_runs, run_round
from moerl.rl.evaluate import evaluate
from moerl.rollout.types import Sample


class Engines:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, float, int]] = []  # prompts, n, temperature, max

    def generate(self, prompts: list[list[int]], n: int, sampling: Any) -> list[list[Sample]]:
        self.calls.append((len(prompts), n, sampling.temperature, sampling.max_tokens))
        return [[Sample(tuple(p), (1,) * (i + 1), (-1.0,) * (i + 1),
                        "length" if i == 0 else "stop", 0, text=str(i)) for i in range(n)]
                for p in prompts]


class Judges:
    def score(self, items: list[ScoreItem], step: int) -> ScoreReport:
        return ScoreReport([RewardResult(reward=1.0 if item.completion == "1" else 0.0,
                                         seconds=0.5) for item in items])


class Episodes:
    """Stands in for the agent collector: every episode of a task solves it but the first."""

    config = AgentTasksConfig()

    def __init__(self) -> None:
        self.runs: list[tuple[list[str], int, float | None]] = []

    def task(self, task_id: str) -> str:
        return task_id

    def run_groups(self, engines: Any, tasks: list[str], group_size: int, cfg: RLConfig,
                   seed: int, temperature: float | None = None) -> list[list[Trajectory]]:
        self.runs.append((list(tasks), group_size, temperature))
        return [[Trajectory(t, [1], [Segment("model", [5, 6], [0.0, 0.0])], status="submitted",
                            reward=float(i > 0)) for i in range(group_size)] for t in tasks]


def _records() -> list[PromptRecord]:
    return [PromptRecord("c/0", "a", "format", domain="code"),
            PromptRecord("m/0", "b", "math", domain="math"),
            PromptRecord("c/1", "c", "format", domain="code"),
            PromptRecord("t/0", "d", EPISODE, {"task": "files-count"}, domain="terminal")]


def _generation(cfg: RLConfig) -> tuple[Generation, Engines, Episodes]:
    runs = domain_runs({
        "code": DomainConfig(),
        "math": DomainConfig(group_size=3, sampling=DomainSampling(max_tokens=7, temperature=0.5)),
        "terminal": DomainConfig(source="terminal", group_size=2)}, cfg)
    engines, episodes = Engines(), Episodes()
    gen = Generation(cast(Any, engines), cast(Any, Judges()), lambda r: [ord(r.prompt)], (),
                     runs, cast(AgentCollector, episodes))
    return gen, engines, episodes


def test_each_domain_is_sampled_with_its_settings_and_groups_keep_the_order() -> None:
    cfg = RLConfig(group_size=4)
    gen, engines, episodes = _generation(cfg)
    groups, _ = run_round(gen, cfg, _records(), seed=1, step=0)
    assert sorted(engines.calls) == sorted([(2, 4, 1.0, 32), (1, 3, 0.5, 7)])
    assert episodes.runs == [(["files-count"], 2, None)]
    assert [g.record.uid for g in groups] == ["c/0", "m/0", "c/1", "t/0"]
    assert [len(g.rewards()) for g in groups] == [4, 3, 4, 2]
    assert isinstance(groups[3], EpisodeGroup) and groups[3].informative


def test_per_domain_metrics_count_samples_rewards_and_truncation() -> None:
    cfg = RLConfig(group_size=4)
    gen, _, _ = _generation(cfg)
    metrics = domain_metrics(run_round(gen, cfg, _records(), seed=1, step=0)[0])
    assert metrics["domain_samples/code"] == 8 and metrics["domain_samples/math"] == 3
    assert metrics["domain_samples/terminal"] == 2
    assert metrics["domain_reward/code"] == 0.25  # one of four completions is "1"
    assert metrics["domain_pass_rate/terminal"] == 0.5
    assert metrics["domain_truncated/math"] == 1 / 3  # the first sample hit the limit
    assert metrics["domain_length/code"] == 2.5
    assert metrics["domain_reward_seconds/code"] == 0.5
    assert "domain_reward_seconds/terminal" not in metrics  # no reward server involved
    assert metrics["domain_infra_errors/math"] == 0


def test_evaluation_is_one_greedy_sample_a_prompt_per_domain() -> None:
    cfg = RLConfig(group_size=4, eval_temperature=0.0)
    gen, engines, episodes = _generation(cfg)
    scores = evaluate(gen, cfg, _records(), step=3)
    assert {(n, t) for _, n, t, _ in engines.calls} == {(1, 0.0)}
    assert episodes.runs == [(["files-count"], 1, 0.0)]
    assert scores["eval_reward/code"] == 0.0 and scores["eval_pass_rate/terminal"] == 0.0
    assert scores["eval/pass_rate"] == 0.0 and "eval_pass_rate/math" in scores
