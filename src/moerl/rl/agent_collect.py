"""The RL loop's collect step for agent episodes (`rl.task_source=agent`).

Per round: pick `rl.prompts_per_step` tasks from the shipped suite (a seeded choice
per step, so a resumed run picks the same ones), run each `rl.group_size` times
through the agent scheduler against the rollout servers, with commands in the real
sandbox (on the environment servers, `moerl serve env`, or with `environments.servers=0`
in this process), and score every episode with its task's verifier. An episode becomes one
training sequence (trajectory.py): the prompt, then the model's tokens (loss mask 1,
the engine's logprobs) interleaved with observations (loss mask 0). Advantages are
computed per group of the same task, as for single-shot prompts. Infra failures are
never trained on, only counted; with dynamic sampling, groups whose rewards are all
equal are dropped and more rounds run, up to `rl.max_generation_rounds`.
"""

from __future__ import annotations

import hashlib
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
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
from moerl.observability import StepTimer
from moerl.rl.batch import Batch, HasEngines
from moerl.rl.config import AgentTasksConfig, RLConfig
from moerl.rl.scoring import advantages, has_spread
from moerl.rollout.client import RolloutClient
from moerl.sandbox import Sandbox, SandboxConfig
from moerl.typed_config import ConfigError

EPISODE = "episode"
"""The `reward` of a terminal-domain record: graded by its task's check in the episode."""


def pick_tasks(tasks: Sequence[SuiteTask], count: int, seed: int) -> list[AgentTask]:
    """`count` tasks drawn without replacement (cycling when count exceeds the suite)."""
    rng = random.Random(seed)
    order: list[SuiteTask] = []
    while len(order) < count:
        order += rng.sample(list(tasks), len(tasks))
    return [t.task for t in order[:count]]


def group_samples(groups: Sequence[Sequence[Trajectory]], cfg: RLConfig,
                  loss_on_truncated_context: bool, first_group_id: int = 0) -> list[RLSample]:
    """Training samples with group advantages; infra failures and episodes without a
    single loss token are left out of their group (fewer than 2 left: no group)."""
    out: list[RLSample] = []
    for gid, group in enumerate(groups, start=first_group_id):
        records: list[AgentSample] = []
        for traj in group:
            if traj.is_infra_failure:
                continue
            rec = traj.to_record(loss_on_truncated_context=loss_on_truncated_context)
            if any(rec.loss_mask):
                records.append(rec)
        if len(records) < 2:
            continue
        rewards = torch.tensor([[r.reward for r in records]], dtype=torch.float32)
        for rec, adv in zip(records, advantages(rewards, cfg.advantage)[0].tolist(), strict=True):
            out.append(rec.to_rl_sample(advantage=float(adv), group_id=gid))
    return out


def informative(group: Sequence[Trajectory]) -> bool:
    return has_spread([t.reward for t in group])


def episode_metrics(groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
    trajs = [t for g in groups for t in g]
    scored = [t for t in trajs if t.reward is not None]
    model_tokens = [sum(len(s.token_ids) for s in t.segments if s.role == "model") for t in trajs]

    def mean(values: Sequence[float]) -> float:
        return statistics.fmean(values) if values else 0.0

    return {
        "reward/mean": mean([t.reward for t in scored if t.reward is not None]),
        "reward/pass_rate": mean([t.reward == 1.0 for t in scored]),
        "reward/infra_errors": float(len(trajs) - len(scored)),
        "rollout/response_length": mean(model_tokens),
        "rollout/informative_groups": float(sum(informative(g) for g in groups)),
        "agent/turns": mean([t.model_turns for t in trajs]),
        "agent/episode_tokens": mean([t.num_tokens for t in trajs]),
        "agent/submitted": mean([t.status == "submitted" for t in trajs]),
        "agent/env_faults": float(sum(t.env_faults for t in trajs)),
        "agent/truncations": float(sum(len(t.truncations) for t in trajs)),
    }


class AgentCollector:
    """`collector(ctl, cfg, step) -> Batch`: the loop's collect over agent episodes."""

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
        """The groups the last call trained on (for inspection and tests)."""

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

    def run_groups(self, engines: RolloutClient, tasks: Sequence[AgentTask], group_size: int,
                   cfg: RLConfig, seed: int, temperature: float | None = None,
                   ) -> list[list[Trajectory]]:
        """`group_size` episodes of each task (a group each), all scheduled at once."""
        episodes = [t for t in tasks for _ in range(group_size)]
        config = self._scheduler_config(cfg, seed)
        if temperature is not None:
            config = replace(config, temperature=temperature)
        trajs = AgentScheduler(engines, self._environment, self.tokenizer, config).run(episodes)
        return [trajs[i : i + group_size] for i in range(0, len(trajs), group_size)]

    def task(self, task_id: str) -> AgentTask:
        """The selected task of that id (a terminal-domain record's `spec["task"]`)."""
        found = self._by_id.get(task_id)
        if found is None:
            raise ValueError(f"agent task {task_id!r} is not among the selected tasks "
                             "(rl.agent.tasks / categories / task_dirs)")
        return found

    def __call__(self, ctl: HasEngines, cfg: RLConfig, step: int) -> Batch:
        timer, kept, seen = StepTimer(), list[list[Trajectory]](), list[list[Trajectory]]()
        for round_ in range(cfg.max_generation_rounds):
            seed = (cfg.seed * 100_003 + step) * 101 + round_
            tasks = pick_tasks(self.tasks, cfg.prompts_per_step, seed)
            with timer.phase("rollout"):
                groups = self.run_groups(ctl.engines, tasks, cfg.group_size, cfg, seed)
            seen += groups
            kept += [g for g in groups if informative(g)] if cfg.dynamic_sampling else groups
            if len(kept) >= cfg.prompts_per_step or not cfg.dynamic_sampling:
                break
        kept = self.last_groups = kept[: cfg.prompts_per_step]
        samples = group_samples(kept, cfg, self.config.loss_on_truncated_context)
        return Batch(samples, {**episode_metrics(seen), **timer.as_metrics()})


def split_terminal_tasks(tasks: Sequence[SuiteTask]) -> tuple[list[SuiteTask], list[SuiteTask]]:
    """The selected tasks as (train, held out): a quarter of them (rounded down), chosen by
    a hash of each task's id so the split does not depend on any seed, are held out and
    never trained on. A selection of fewer than four tasks holds out none."""
    ranked = sorted(tasks, key=lambda t: hashlib.sha256(t.id.encode()).hexdigest())
    held_out = {t.id for t in ranked[: len(ranked) // 4]}
    return ([t for t in tasks if t.id not in held_out], [t for t in tasks if t.id in held_out])


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
        return [PromptRecord(uid=f"{split}-{t.id}", prompt=t.task.instruction, reward=EPISODE,
                             spec={"task": t.id}) for t in tasks[:count]]

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
