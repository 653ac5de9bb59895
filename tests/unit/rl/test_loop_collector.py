"""Agent tasks (`rl.task_source=agent`) go through the loop's one collect path: their
records come from the prompt stream, each round's episode groups are filtered and
trained like prompt groups. Fakes stand in for the servers and the episodes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from stand_in_policy import StandInPolicy, peers

from moerl.agent.trajectory import Segment, Trajectory
from moerl.data.prompts import PromptStream
from moerl.data.rl_batch import RLSample
from moerl.observability import LoggerConfig, MetricsLogger, read_metrics
from moerl.rl.agent_collect import AgentCollector, task_records
from moerl.rl.config import AgentTasksConfig, RLConfig
from moerl.rl.loop import Controller, collect, run_steps


class RecordingPolicy(StandInPolicy):
    def __init__(self) -> None:
        self.batches: list[list[RLSample]] = []

    def train_on(self, samples: list[RLSample]) -> dict[str, float]:
        self.batches.append(samples)
        return {"tokens": float(sum(int(s.loss_mask.sum()) for s in samples
                                    if s.loss_mask is not None))}  # fmt: skip


class Task:
    def __init__(self, task_id: str) -> None:
        self.id, self.task = task_id, SimpleNamespace(instruction=f"do {task_id}")


class Episodes:
    """Stands in for the agent collector. Episodes: model (3 tokens) | observation (2) |
    model (1); every episode of task "solved" fails but the last, every one of "hard"
    fails (a group without spread)."""

    config = AgentTasksConfig()

    def __init__(self) -> None:
        self.runs: list[list[str]] = []
        self.version = 0

    def task(self, task_id: str) -> str:
        return task_id

    def run_groups(self, engines: Any, tasks: list[str], group_size: int, cfg: RLConfig,
                   seed: int, temperature: float | None = None) -> list[list[Trajectory]]:
        self.runs.append(list(tasks))
        segments = [Segment("model", [5, 6, 7], [-1.0] * 3, weight_version=self.version),
                    Segment("observation", [8, 9]),
                    Segment("model", [10], [-1.0], weight_version=self.version)]
        return [[Trajectory(t, [1, 2], segments, status="submitted",
                            reward=float(t == "solved" and i == group_size - 1))
                 for i in range(group_size)] for t in tasks]


class Publish:
    """Stands in for the weight sync: the episodes sample at the version last pushed."""

    def __init__(self, episodes: Episodes) -> None:
        self.episodes = episodes

    def push(self, policy: Any, version: int) -> None:
        self.episodes.version = version


def _controller(tmp_path: Path, episodes: Episodes) -> Controller:
    logger = MetricsLogger(LoggerConfig(wandb_mode="disabled", plot=False), tmp_path, {})
    records = task_records([cast(Any, Task("solved")), cast(Any, Task("hard"))])
    return Controller(None, None, PromptStream(records, seed=0), [],  # type: ignore[arg-type]
                      lambda r: [], logger, episodes=cast(AgentCollector, episodes))


def test_dynamic_sampling_drops_episode_groups_without_spread(tmp_path: Path) -> None:
    episodes = Episodes()
    cfg = RLConfig(prompts_per_step=2, group_size=2, dynamic_sampling=True,
                   max_generation_rounds=3)
    batch = collect(_controller(tmp_path, episodes), cfg, step=0)
    # Each round takes the next two tasks of the stream; only "solved" groups are kept.
    assert [sorted(r) for r in episodes.runs] == [["hard", "solved"]] * 2
    assert {s.group_id for s in batch.samples} == {0, 1} and len(batch.samples) == 4
    assert batch.metrics["rollout/informative_groups"] == 2.0  # of 4 seen
    assert batch.metrics["reward/pass_rate"] == 0.25 and batch.metrics["agent/turns"] == 2.0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_agent_tasks_train_through_the_loop(tmp_path: Path, mode: str) -> None:
    episodes = Episodes()
    policy = RecordingPolicy()
    cfg = RLConfig(steps=3, prompts_per_step=1, group_size=2, mode=mode,  # type: ignore[arg-type]
                   dynamic_sampling=False, eval_interval=0)
    run_steps(cfg, peers(policy), Publish(episodes), _controller(tmp_path, episodes))  # type: ignore[arg-type]
    assert len(episodes.runs) >= 3 and all(len(r) == 1 for r in episodes.runs)
    assert [len(b) for b in policy.batches] == [2, 2, 2]
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/tokens" in r]
    assert [r["train/tokens"] for r in rows] == [8.0] * 3  # model tokens only: 4 a sample
    assert all(r["agent/turns"] == 2.0 and r["rollout/response_length"] == 4.0 for r in rows)
