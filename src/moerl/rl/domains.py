"""One round of a step over prompts of many domains: each domain generated with its own
sampling settings and group size, single-shot prompts scored together on the reward
servers, terminal-domain prompts run as agent episodes; and the per-domain metrics.

Per-domain metrics, one series per domain (W&B sections by metric, a line per domain):

    domain_samples/<d>        samples generated this step
    domain_reward/<d>         mean reward of the scored samples
    domain_pass_rate/<d>      share of scored samples with reward 1
    domain_length/<d>         mean response length (model tokens)
    domain_truncated/<d>      share of samples cut at the token limit
    domain_reward_seconds/<d> mean time of the reward function per sample (server side)
    domain_infra_errors/<d>   samples without a reward because the system failed
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from moerl.data.domain_config import DomainConfig
from moerl.data.prompts import PromptRecord
from moerl.observability import StepTimer
from moerl.rewards.client import RewardClient
from moerl.rl.agent_collect import EPISODE, AgentCollector, EpisodeGroup
from moerl.rl.config import RLConfig, SamplingConfig
from moerl.rl.group import Group, Outcome, mean_or_zero
from moerl.rl.scoring import score_groups
from moerl.rollout.client import RolloutClient
from moerl.rollout.types import Sample


@dataclass(frozen=True)
class DomainRun:
    """How one domain's prompts are sampled: its group size and sampling settings."""

    group_size: int
    sampling: SamplingConfig


def domain_runs(domains: Mapping[str, DomainConfig], cfg: RLConfig) -> dict[str, DomainRun]:
    """Each domain's overrides applied to the run's `rl.group_size` and `rl.sampling`."""
    runs = {}
    for name, domain in domains.items():
        s = domain.sampling
        sampling = replace(
            cfg.sampling,
            max_tokens=s.max_tokens if s.max_tokens is not None else cfg.sampling.max_tokens,
            temperature=(s.temperature if s.temperature is not None
                         else cfg.sampling.temperature),
            stop=list(s.stop) if s.stop is not None else list(cfg.sampling.stop))
        runs[name] = DomainRun(domain.group_size or cfg.group_size, sampling)
    return runs


@dataclass
class Generation:
    """The clients and settings one round generates with (the controller's)."""

    rollout_client: RolloutClient
    reward_client: RewardClient
    encode: Callable[[PromptRecord], list[int]]
    stop_token_ids: tuple[int, ...]
    runs: Mapping[str, DomainRun]
    episodes: AgentCollector | None


def run_round(gen: Generation, cfg: RLConfig, records: Sequence[PromptRecord], seed: int,
              step: int, temperature: float | None = None, group_size: int | None = None,
              timer: StepTimer | None = None) -> tuple[list[Group], dict[str, float]]:
    """Every record's group, in the records' order, and the reward client's metrics.
    `temperature` and `group_size` replace every domain's (held-out evaluation); `timer`
    times the phases rollout (generation and episodes) and reward.

    Domains are generated one after another, not sent together: the rows of a static
    batch all sit at one position (rollout/static_decode.py), so a documents prompt
    of 1,800 tokens beside 60-token ones is read one token a decode step and the
    whole batch runs that many steps (the multidomain experiment's rollout took 2.5
    times as long with the domains sent together)."""
    timer = timer or StepTimer()
    default = DomainRun(cfg.group_size, cfg.sampling)
    by_domain: dict[str, list[int]] = defaultdict(list)
    episodes: list[int] = []
    for index, record in enumerate(records):
        (episodes if record.reward == EPISODE else by_domain[record.domain]).append(index)
    samples: dict[int, list[Sample]] = {}
    for domain, indices in by_domain.items():
        run = gen.runs.get(domain, default)
        n = group_size or run.group_size
        sampling = run.sampling if temperature is None else replace(run.sampling,
                                                                    temperature=temperature)
        with timer.phase("rollout"):
            got = gen.rollout_client.generate([gen.encode(records[i]) for i in indices], n=n,
                                       sampling=sampling.params(
                                           n, seed=seed, stop_token_ids=gen.stop_token_ids,
                                           routed_experts=cfg.routing_replay
                                           and group_size is None))
        samples.update(zip(indices, got, strict=True))
    groups: dict[int, Group] = {}
    metrics: dict[str, float] = {}
    if samples:
        order = sorted(samples)
        with timer.phase("reward"):
            scored, metrics = score_groups(gen.reward_client, [records[i] for i in order],
                                           [samples[i] for i in order], step)
        groups.update(zip(order, scored, strict=True))
    if episodes:
        if gen.episodes is None:
            raise RuntimeError("terminal-domain prompts need the agent collector "
                               "(the trainer builds it for a mixture with a terminal domain)")
        by_size: dict[int, list[int]] = defaultdict(list)
        for i in episodes:
            by_size[group_size or gen.runs.get(records[i].domain, default).group_size].append(i)
        for n, indices in by_size.items():
            tasks = [gen.episodes.task(str(records[i].spec["task"])) for i in indices]
            with timer.phase("rollout"):
                trajs = gen.episodes.run_groups(gen.rollout_client, tasks, n, cfg, seed,
                                                temperature)
            truncated_loss = gen.episodes.config.loss_on_truncated_context
            groups.update({i: EpisodeGroup(records[i], t, truncated_loss)
                           for i, t in zip(indices, trajs, strict=True)})
    return [groups[i] for i in range(len(records))], metrics


def domain_metrics(groups: Sequence[Group], prefix: str = "domain_") -> dict[str, float]:
    """The per-domain series of the module docstring over `groups` (records outside a
    mixture, whose domain is "", are left out)."""
    by_domain: dict[str, list[Outcome]] = defaultdict(list)
    for group in groups:
        if group.record.domain:
            by_domain[group.record.domain] += group.outcomes()
    out: dict[str, float] = {}
    for name, outcomes in sorted(by_domain.items()):
        scored = [o.reward for o in outcomes if o.reward is not None]
        seconds = [o.seconds for o in outcomes if o.seconds is not None]
        out |= {
            f"{prefix}samples/{name}": float(len(outcomes)),
            f"{prefix}reward/{name}": mean_or_zero(scored),
            f"{prefix}pass_rate/{name}": mean_or_zero([r == 1.0 for r in scored]),
            f"{prefix}length/{name}": mean_or_zero([o.length for o in outcomes]),
            f"{prefix}truncated/{name}": mean_or_zero([o.truncated for o in outcomes]),
            f"{prefix}infra_errors/{name}": float(len(outcomes) - len(scored)),
        }
        if seconds:
            out[f"{prefix}reward_seconds/{name}"] = mean_or_zero(seconds)
    return out
