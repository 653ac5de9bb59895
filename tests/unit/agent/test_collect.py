"""Agent episodes -> the loop's training samples: group advantages, masks, and what is
left out (infra failures, episodes without a model token to train on)."""

from __future__ import annotations

import pytest

from moerl.agent.suite import select_tasks
from moerl.agent.trajectory import Segment, Trajectory
from moerl.rl.agent_collect import (
    EPISODE,
    AgentCollector,
    EpisodeGroup,
    agent_task_records,
    episode_samples,
)
from moerl.rl.config import AgentTasksConfig, RLConfig
from moerl.rl.group import group_metrics


def _traj(reward: float | None, model: list[int], truncated: bool = False) -> Trajectory:
    segs = [Segment("model", model, [-0.5] * len(model), context_truncated=truncated),
            Segment("observation", [7, 7, 7])]  # fmt: skip
    status = "infra_failure" if reward is None else "submitted"
    return Trajectory("t", [1, 2], segs, status=status, reward=reward)  # type: ignore[arg-type]


def test_group_advantages_and_masks() -> None:
    cfg = RLConfig(group_size=2, advantage="grpo_no_std")
    groups = [[_traj(1.0, [5, 6]), _traj(0.0, [8])],
              [_traj(1.0, [5]), _traj(None, [6])],  # one left after the infra failure: no group
              [_traj(0.0, [5]), _traj(1.0, [6], truncated=True), _traj(1.0, [9])]]  # fmt: skip
    samples = [s for gid, g in enumerate(groups) for s in episode_samples(g, cfg, False, gid)]
    assert [s.group_id for s in samples] == [0, 0, 2, 2]
    assert [s.advantage for s in samples] == [0.5, -0.5, -0.5, 0.5]
    assert samples[0].loss_mask.tolist() == [1, 1, 0, 0, 0]
    assert samples[0].rollout_logprobs.tolist() == [-0.5, -0.5, 0.0, 0.0, 0.0]
    # the truncated-context episode had no loss token: left out, the group keeps two
    assert [s.completion_ids.tolist() for s in samples[2:]] == [[5, 7, 7, 7], [9, 7, 7, 7]]
    assert len(episode_samples(groups[2], cfg, True, 2)) == 3


def test_episode_groups_ignore_infra_failures_in_spread_and_metrics() -> None:
    record = agent_task_records(AgentTasksConfig(tasks=["files-create-greeting"]))[0]
    assert record.reward == EPISODE and record.spec == {"task": "files-create-greeting"}
    spread = EpisodeGroup(record, [_traj(1.0, [1]), _traj(0.0, [1, 2])])
    flat = EpisodeGroup(record, [_traj(1.0, [1]), _traj(None, [1]), _traj(1.0, [1])])
    assert spread.informative and not flat.informative
    # Trained on only when kept (dynamic sampling drops it): no spread, no advantage.
    assert [s.advantage for s in flat.to_samples(RLConfig(), 0)] == [0.0, 0.0]
    metrics = group_metrics([spread, flat])
    assert metrics["reward/infra_errors"] == 1.0 and metrics["rollout/informative_groups"] == 1
    assert metrics["reward/pass_rate"] == 0.75 and metrics["rollout/response_length"] == 1.2


def test_a_collector_needs_tasks() -> None:
    assert select_tasks(categories=["git"])
    with pytest.raises(ValueError, match="no tasks"):
        AgentCollector([], None, None, None)  # type: ignore[arg-type]
