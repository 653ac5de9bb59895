"""Agent episodes -> the loop's training samples: group advantages, masks, and what is
left out (infra failures, episodes without a model token to train on)."""

from __future__ import annotations

import pytest

from moerl.agent.suite import select_tasks
from moerl.agent.trajectory import Segment, Trajectory
from moerl.rl.agent_collect import AgentCollector, group_samples, informative, pick_tasks
from moerl.rl.config import RLConfig


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
    samples = group_samples(groups, cfg, loss_on_truncated_context=False)
    assert [s.group_id for s in samples] == [0, 0, 2, 2]
    assert [s.advantage for s in samples] == [0.5, -0.5, -0.5, 0.5]
    assert samples[0].loss_mask.tolist() == [1, 1, 0, 0, 0]
    assert samples[0].rollout_logprobs.tolist() == [-0.5, -0.5, 0.0, 0.0, 0.0]
    # the truncated-context episode had no loss token: left out, the group keeps two
    assert [s.completion_ids.tolist() for s in samples[2:]] == [[5, 7, 7, 7], [9, 7, 7, 7]]
    assert len(group_samples(groups, cfg, loss_on_truncated_context=True)) == 5


def test_informative_ignores_infra_failures() -> None:
    assert informative([_traj(1.0, [1]), _traj(0.0, [1])])
    assert not informative([_traj(1.0, [1]), _traj(None, [1]), _traj(1.0, [1])])


def test_task_choice_is_seeded_and_cycles() -> None:
    tasks = select_tasks(categories=["git"])
    assert pick_tasks(tasks, 3, seed=4) == pick_tasks(tasks, 3, seed=4)
    many = pick_tasks(tasks, 2 * len(tasks), seed=1)
    assert sorted(t.id for t in many) == sorted(t.id for t in tasks for _ in range(2))
    with pytest.raises(ValueError, match="no tasks"):
        AgentCollector([], None, None, None)  # type: ignore[arg-type]
