"""The `rewards` config group: the reward servers and how the trainer calls them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class RewardStageConfig:
    """The `rewards` group: the reward servers and how the trainer calls them."""

    servers: int = 1
    max_concurrency: int = 2  # sandboxed executions at once per server
    warm_slots: int | None = None
    """Sandbox executions each server keeps launched ahead of a request (`--warm-slots`);
    None: as many as max_concurrency; 0: launch every execution on demand."""
    isolation: Literal["strict", "no-cgroups"] = "strict"
    batch_size: int = 64  # items per request; at most the servers' --max-batch-items (1024)
    timeout_s: float = 300.0
    nodes: int = 1
    cpus: int = 2
    plugins: dict[str, str] = field(default_factory=dict)
    """Reward functions served beside the built-in ones: name -> 'package.module:Factory'
    (moerl.rewards.registry), for a domain whose prompts name them."""

    def __post_init__(self) -> None:
        for name, path in self.plugins.items():
            module, sep, attr = path.partition(":")
            if not (sep and module and attr):
                raise ValueError(f"rewards.plugins.{name}: {path!r} must look like "
                                 "'package.module:Factory'")
