"""The config of one domain of a mixture (`data.domains.<name>`, Hydra group `domain`).

A domain is a name, a prompt source, the reward function that grades it on the reward
servers (or, for `terminal`, the tasks' own verifiers in the environment), a held-out
set, and its sampling settings. The shipped ones are configs/domain/*.yaml; a user adds
one with a YAML file of the same form:

    # @package data.domains
    mine:
      source: mypkg.prompts:generate   # or a shipped generator, or jsonl
      reward: mine                     # rewards.plugins.mine: mypkg.rewards:MyReward
      train_size: 500
      eval_size: 16

and a weight in `data.mixture`. Sources: the shipped generators `code`, `programs`,
`math`, `documents` and `tools` (moerl.data.domains), `jsonl` (`path`, `eval_path`),
`terminal` (the agent suite selected by `rl.agent`, run as multi-step episodes), or an
import path `package.module:function` with the generator signature of
moerl.data.domains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SHIPPED_SOURCES = ("code", "programs", "math", "documents", "tools", "jsonl", "terminal")


@dataclass
class DomainSampling:
    """A domain's overrides of `rl.sampling` (null: the run's value)."""

    max_tokens: int | None = None
    temperature: float | None = None
    stop: list[str] | None = None


@dataclass
class DomainConfig:
    source: str = "code"
    reward: str | None = None
    """The reward function's name on the reward servers for every prompt of the domain;
    null: each record's own (a generator's choice, a JSONL row's `reward`)."""
    path: str | None = None  # jsonl: training rows
    eval_path: str | None = None  # jsonl: held-out rows
    train_size: int = 1000  # generated prompts (a generator source)
    eval_size: int = 16  # held-out prompts (generated from another seed, or the first rows)
    seed: int | None = None  # null: data.seed
    options: dict[str, Any] = field(default_factory=dict)  # the generator's options
    max_prompt_tokens: int | None = None  # null: data.max_prompt_tokens
    group_size: int | None = None  # null: rl.group_size
    sampling: DomainSampling = field(default_factory=DomainSampling)

    def check(self, name: str) -> None:
        """Refuse what cannot work, naming `data.domains.<name>.<field>`."""
        where = f"data.domains.{name}"
        if self.source not in SHIPPED_SOURCES and ":" not in self.source:
            raise ValueError(
                f"{where}.source: {self.source!r} is neither a shipped source "
                f"({', '.join(SHIPPED_SOURCES)}) nor an import path 'package.module:function'")
        if self.source == "jsonl" and not self.path:
            raise ValueError(f"{where}.path: source=jsonl needs a .jsonl file of prompts")
        if self.train_size < 1 or self.eval_size < 0:
            raise ValueError(f"{where}.train_size / eval_size: need train_size >= 1 and "
                             "eval_size >= 0")
        if self.group_size is not None and self.group_size < 2:
            raise ValueError(f"{where}.group_size: group advantages need >= 2 samples")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"{where}.max_prompt_tokens: must be >= 1 (or null)")
        s = self.sampling
        if s.max_tokens is not None and s.max_tokens < 1:
            raise ValueError(f"{where}.sampling.max_tokens: must be >= 1 (or null)")
        if s.temperature is not None and s.temperature < 0:
            raise ValueError(f"{where}.sampling.temperature: must be >= 0 (or null)")
        if self.source == "terminal" and (self.reward or self.sampling.stop):
            raise ValueError(f"{where}: terminal episodes are graded by their tasks' checks "
                             "and sampled with rl.agent's limits; remove reward and "
                             "sampling.stop")


def check_mixture(mixture: dict[str, float], domains: dict[str, DomainConfig]) -> None:
    """Every weighted domain is defined, weights are >= 0 and one is > 0."""
    if not mixture:
        raise ValueError("data.mixture: source=mixture needs domain weights, e.g. "
                         "data.mixture={code: 1.0, math: 1.0}")
    for name, weight in mixture.items():
        if name not in domains:
            raise ValueError(
                f"data.mixture.{name}: no domain {name!r} is defined; have "
                f"{sorted(domains) or 'none'} (select it: domain=[...,{name}] or add "
                f"configs/domain/{name}.yaml)")
        if not weight >= 0:
            raise ValueError(f"data.mixture.{name}: a weight must be >= 0, got {weight}")
    if not any(w > 0 for w in mixture.values()):
        raise ValueError("data.mixture: at least one weight must be > 0")
    for name, domain in domains.items():
        domain.check(name)
