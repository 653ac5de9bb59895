"""The `environments` config group: the environment servers of agent runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class EnvironmentStageConfig:
    """The `environments` group (`moerl serve env`, used when rl.task_source=agent)."""

    servers: int = 1  # 0: the episodes' sandboxes run in the trainer's process
    nodes: int = 1
    cpus: int = 2
    max_sessions: int = 64
    idle_timeout_s: float = 600.0
    isolation: Literal["strict", "no-cgroups"] = "strict"

    def __post_init__(self) -> None:
        if self.servers < 0 or self.max_sessions < 1 or self.idle_timeout_s <= 0:
            raise ValueError("environments: need servers >= 0, max_sessions >= 1 and "
                             "idle_timeout_s > 0")
