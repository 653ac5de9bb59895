"""Agent episodes as groups of the RL loop: `rl.task_source=agent`, and a mixture's
`terminal` domain.

A terminal task is a prompt record (`reward` "episode", `spec["task"]` its id); the
loop's one collect path (`loop.collect` -> `domains.run_round`) hands such records to
the `AgentCollector`, which runs each `group_size` times through the agent scheduler
against the rollout servers, with commands in the real sandbox (on the environment
servers, `moerl serve env`, or with `environments.servers=0` in this process), and
grades every episode with its task's check. An `EpisodeGroup` becomes training
sequences (trajectory.py): the prompt, then the model's tokens (loss mask 1, the
engine's logprobs) interleaved with observations (loss mask 0); advantages per group
of the same task, as for single-shot prompts. Infra failures are never trained on,
only counted.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from moerl.agent.environment import AgentTask, Environment
from moerl.agent.remote import EnvironmentServers, RemoteEnvironment
from moerl.agent.scheduler import AgentScheduler, SchedulerConfig
from moerl.agent.suite import SuiteTask, select_tasks
from moerl.agent.terminal import TerminalEnvironment
from moerl.agent.trajectory import AgentSample, Trajectory
from moerl.data.domains import Generator
from moerl.data.prompts import PromptRecord
from moerl.data.rl_batch import RLSample
from moerl.data.tokenizer import Tokenizer
from moerl.rl.config import AgentTasksConfig, RLConfig
from moerl.rl.group import Outcome, has_spread, mean_or_zero
from moerl.rl.scoring import advantages
from moerl.rollout.client import RolloutClient
from moerl.rollout.types import Sample
from moerl.sandbox import Sandbox, SandboxConfig
from moerl.typed_config import ConfigError

EPISODE = "episode"
"""The `reward` of a terminal-domain record: graded by its task's check in the episode."""


def episode_samples(group: Sequence[Trajectory], cfg: RLConfig, loss_on_truncated_context: bool,
                    group_id: int) -> list[RLSample]:
    """One group's training samples with group advantages; infra failures and episodes
    without a single loss token are left out (fewer than 2 left: none)."""
    records: list[AgentSample] = []
    for traj in group:
        if traj.is_infra_failure:
            continue
        rec = traj.to_record(loss_on_truncated_context=loss_on_truncated_context)
        if any(rec.loss_mask):
            records.append(rec)
    if len(records) < 2:
        return []
    rewards = torch.tensor([[r.reward for r in records]], dtype=torch.float32)
    return [rec.to_rl_sample(advantage=float(adv), group_id=group_id)
            for rec, adv in zip(records, advantages(rewards, cfg.advantage)[0].tolist(),
                                strict=True)]


@dataclass
class EpisodeGroup:
    """A terminal task's episodes, graded by the task's check (a `Group`)."""

    record: PromptRecord
    trajectories: list[Trajectory]
    loss_on_truncated_context: bool = False

    @property
    def samples(self) -> Sequence[Sample]:
        return ()

    def rewards(self, cfg: RLConfig | None = None) -> list[float | None]:
        return [None if t.is_infra_failure else t.reward for t in self.trajectories]

    @property
    def informative(self) -> bool:
        return has_spread(self.rewards())

    def outcomes(self) -> list[Outcome]:
        return [Outcome(None if t.is_infra_failure else t.reward, model_tokens(t),
                        bool(t.truncations) or t.status != "submitted",
                        t.status == "submitted") for t in self.trajectories]

    def to_samples(self, cfg: RLConfig, group_id: int) -> list[RLSample]:
        return episode_samples(self.trajectories, cfg, self.loss_on_truncated_context,
                               group_id)


def model_tokens(traj: Trajectory) -> int:
    return sum(len(s.token_ids) for s in traj.segments if s.role == "model")


def agent_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """The agent/* series over a step's episodes (rewards and lengths: `group_metrics`)."""
    return {
        "agent/turns": mean_or_zero([t.model_turns for t in trajectories]),
        "agent/episode_tokens": mean_or_zero([t.num_tokens for t in trajectories]),
        "agent/submitted": mean_or_zero([t.status == "submitted" for t in trajectories]),
        "agent/env_faults": float(sum(t.env_faults for t in trajectories)),
        "agent/truncations": float(sum(len(t.truncations) for t in trajectories)),
    }


class AgentCollector:
    """Runs terminal tasks' episodes for the loop's rounds (`domains.run_round`)."""

    def __init__(self, tasks: Sequence[SuiteTask], sandbox: Sandbox | None, tokenizer: Tokenizer,
                 config: AgentTasksConfig, servers: EnvironmentServers | None = None) -> None:
        if not tasks:
            raise ValueError("rl.agent: no tasks selected")
        if (sandbox is None) == (servers is None):
            raise ValueError("an agent collector runs episodes in a sandbox or on "
                             "environment servers: give exactly one")
        self.tasks, self.sandbox, self.servers = list(tasks), sandbox, servers
        self._by_id = {t.id: t.task for t in self.tasks}
        self.tokenizer, self.config = tokenizer, config
        self.last_groups: list[list[Trajectory]] = []
        """The groups `run_groups` last ran (for inspection and tests)."""

    def _scheduler_config(self, cfg: RLConfig, seed: int) -> SchedulerConfig:
        a = self.config
        return SchedulerConfig(
            max_turns=a.max_turns, max_concurrency=a.max_concurrency,
            context_tokens=a.context_tokens, max_new_tokens=a.max_new_tokens,
            max_observation_tokens=a.max_observation_tokens,
            max_episode_tokens=a.max_episode_tokens, temperature=cfg.sampling.temperature,
            seed=seed, compact_tools=a.compact_tools,
        )  # fmt: skip

    def _environment(self) -> Environment:
        if self.servers is not None:
            return RemoteEnvironment(self.servers)
        return TerminalEnvironment(self.sandbox)

    def run_groups(self, rollout_client: RolloutClient, tasks: Sequence[AgentTask], group_size: int,
                   cfg: RLConfig, seed: int, temperature: float | None = None,
                   ) -> list[list[Trajectory]]:
        """`group_size` episodes of each task (a group each), all scheduled at once."""
        episodes = [t for t in tasks for _ in range(group_size)]
        config = self._scheduler_config(cfg, seed)
        if temperature is not None:
            config = replace(config, temperature=temperature)
        scheduler = AgentScheduler(rollout_client, self._environment, self.tokenizer, config)
        trajs = scheduler.run(episodes)
        self.last_groups = [trajs[i : i + group_size] for i in range(0, len(trajs), group_size)]
        return self.last_groups

    def task(self, task_id: str) -> AgentTask:
        """The selected task of that id (a terminal-domain record's `spec["task"]`)."""
        found = self._by_id.get(task_id)
        if found is None:
            raise ValueError(f"agent task {task_id!r} is not among the selected tasks "
                             "(rl.agent.tasks / categories / task_dirs)")
        return found


def split_terminal_tasks(tasks: Sequence[SuiteTask]) -> tuple[list[SuiteTask], list[SuiteTask]]:
    """The selected tasks as (train, held out): a quarter of them (rounded down), chosen by
    a hash of each task's id so the split does not depend on any seed, are held out and
    never trained on. A selection of fewer than four tasks holds out none."""
    ranked = sorted(tasks, key=lambda t: hashlib.sha256(t.id.encode()).hexdigest())
    held_out = {t.id for t in ranked[: len(ranked) // 4]}
    return ([t for t in tasks if t.id not in held_out], [t for t in tasks if t.id in held_out])


def task_records(tasks: Sequence[SuiteTask], split: str = "train",
                 domain: str = "") -> list[PromptRecord]:
    """A record per task: its instruction as the prompt, graded in its episodes."""
    return [PromptRecord(uid=f"{split}-{t.id}", prompt=t.task.instruction, reward=EPISODE,
                         spec={"task": t.id}, domain=domain) for t in tasks]


def agent_task_records(config: AgentTasksConfig) -> list[PromptRecord]:
    """`rl.task_source=agent`'s prompts: a record of every task `rl.agent` selects."""
    return task_records(select_tasks(config.tasks, config.categories, config.task_dirs))


def terminal_source(config: AgentTasksConfig) -> Generator:
    """The `terminal` domain's records: the tasks `rl.agent` selects, in a seeded order
    (at most `count`). A record names its task (`spec["task"]`); its episodes are graded
    by the task's own check, not by a reward server (`reward` "episode"). The held-out
    split draws from tasks the training split never has (`split_terminal_tasks`)."""

    def generate(count: int, seed: int, split: str, options: Mapping[str, Any]
                 ) -> list[PromptRecord]:
        if options:
            raise ValueError(f"options.{sorted(options)[0]}: the terminal domain takes no "
                             "options; select its tasks with rl.agent.tasks / categories / "
                             "task_dirs")
        train, held_out = split_terminal_tasks(
            select_tasks(config.tasks, config.categories, config.task_dirs))
        tasks = held_out if split == "eval" else train
        random.Random(seed).shuffle(tasks)
        return task_records(tasks[:count], split)

    return generate


def build_agent_collector(cfg: RLConfig, max_positions: int, tokenizer: Tokenizer,
                          sandbox: Sandbox | None = None,
                          environment_servers: Sequence[str] = ()) -> AgentCollector:
    """The collector for `rl.task_source=agent`, on `environment_servers` (URLs) if
    any, else in a sandbox of this process; limits that cannot fit the model fail
    here, naming the field."""
    a = cfg.agent
    if a.max_episode_tokens > max_positions:
        raise ConfigError(
            f"rl.agent.max_episode_tokens ({a.max_episode_tokens}) exceeds "
            f"model.max_position_embeddings ({max_positions}): the trainer forwards whole "
            "episodes; lower rl.agent.max_episode_tokens"
        )
    tasks = select_tasks(a.tasks, a.categories, a.task_dirs)
    if environment_servers:
        return AgentCollector(tasks, None, tokenizer, a, EnvironmentServers(environment_servers))
    return AgentCollector(tasks, sandbox or Sandbox(SandboxConfig(isolation=a.isolation)),
                          tokenizer, a)  # fmt: skip
