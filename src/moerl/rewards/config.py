"""The `rewards` config group: the reward servers and how the trainer calls them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class RewardClientConfig:
    """`rewards.client`: how the trainer calls the reward servers (rewards/client.py)."""

    batch_size: int = 64  # items per request; at most the servers' --max-batch-items (1024)
    max_in_flight: int = 4
    """Batches sent at once."""
    timeout_s: float = 300.0
    """Per request; longer than the sandbox's maximum wall time times a batch's depth."""
    max_attempts: int = 5
    backoff_base_s: float = 0.25
    backoff_cap_s: float = 8.0
    retry_item_infra_errors: bool = True
    """Re-score items the server reported as infra errors (with new ids). Safe for the
    built-in rewards, which only run tests; turn off for rewards with side effects."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_in_flight < 1 or self.max_attempts < 1:
            raise ValueError("rewards.client: batch_size, max_in_flight and max_attempts "
                             "must be >= 1")


@dataclass
class RewardStageConfig:
    """The `rewards` group: the reward servers, and the trainer's client of them."""

    servers: int = 1
    max_concurrency: int = 2  # sandboxed executions at once per server
    warm_slots: int | None = None
    """Sandbox executions each server keeps launched ahead of a request (`--warm-slots`);
    None: as many as max_concurrency; 0: launch every execution on demand."""
    isolation: Literal["strict", "no-cgroups"] = "strict"
    nodes: int = 1
    cpus: int = 2
    plugins: dict[str, str] = field(default_factory=dict)
    """Reward functions served beside the built-in ones: name -> 'package.module:Factory'
    (moerl.rewards.registry), for a domain whose prompts name them."""
    client: RewardClientConfig = field(default_factory=RewardClientConfig)

    def __post_init__(self) -> None:
        for name, path in self.plugins.items():
            module, sep, attr = path.partition(":")
            if not (sep and module and attr):
                raise ValueError(f"rewards.plugins.{name}: {path!r} must look like "
                                 "'package.module:Factory'")
