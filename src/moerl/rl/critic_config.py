"""The `rl.critic` group and the start-up checks of PPO with a critic (`rl.advantage=gae`).

No torch here: the run's config is read and checked before anything heavy is imported.
What the fields do is in rl/critic.py (the value model and its update) and
rl/gae_returns.py (GAE from its values).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moerl.models.arch import MoEArch
from moerl.trainer.config import OptimConfig

GAE_DEFAULTS = {"gae_gamma": 1.0, "gae_lambda": 0.95}
# Architecture fields a critic may not change: it reads the policy's token ids.
_FIXED_ARCH = ("vocab_size",)


@dataclass
class CriticConfig:
    """`rl.critic`: the value model V(s_t) of PPO with GAE; used with rl.advantage=gae only.

    The value model is the policy's architecture (or that architecture with the fields of
    `model` replaced) whose vocabulary projection is a scalar head, in the run's parallel
    layout, with an optimizer of its own (`optim` with the fields below replaced) and its
    own entry in each checkpoint.
    """

    model: dict[str, Any] = field(default_factory=dict)
    """Fields of the policy's architecture (`model`) to replace, e.g. {num_layers: 2};
    {}: the policy's architecture."""
    init_from_policy: bool = True
    """Start the trunk from the policy's weights at the start of RL (else: from the seed)."""
    head_init_std: float = 0.0
    """0: a zero head (V = 0 everywhere at the start); > 0: N(0, std^2) from rl.seed."""
    lr: float | None = None  # None: optim.lr
    min_lr: float | None = None  # None: optim.min_lr (at most lr)
    clip_grad: float | None = None  # None: optim.clip_grad
    value_clip: float | None = 0.2
    """eps of the clipped value loss (rl/losses/value.py); None: unclipped."""
    warmup_steps: int = 0
    """RL steps at the start that train only the critic (the policy does not move)."""

    def __post_init__(self) -> None:
        known = {f.name for f in dataclasses.fields(MoEArch)}
        for key in self.model:
            if key not in known:
                raise ValueError(f"rl.critic.model.{key}: not a field of the model "
                                 f"architecture; known: {', '.join(sorted(known))}")
            if key in _FIXED_ARCH:
                raise ValueError(f"rl.critic.model.{key}: the critic reads the policy's "
                                 "tokens, so it keeps the policy's value; remove it")
        if self.model and self.init_from_policy:
            raise ValueError(
                f"rl.critic.model={self.model} with rl.critic.init_from_policy=true: a critic "
                "of another architecture cannot start from the policy's weights; set "
                "rl.critic.init_from_policy=false, or rl.critic.model={}")
        if self.head_init_std < 0:
            raise ValueError(f"rl.critic.head_init_std: must be >= 0, got {self.head_init_std}")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"rl.critic.lr: must be > 0, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= (self.lr or float("inf")):
            raise ValueError(f"rl.critic.min_lr: need 0 <= min_lr <= rl.critic.lr, got "
                             f"{self.min_lr} (lr {self.lr})")
        if self.clip_grad is not None and self.clip_grad < 0:
            raise ValueError(f"rl.critic.clip_grad: must be >= 0, got {self.clip_grad}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"rl.critic.value_clip: must be > 0 (null: unclipped), got "
                             f"{self.value_clip}")
        if self.warmup_steps < 0:
            raise ValueError(f"rl.critic.warmup_steps: must be >= 0, got {self.warmup_steps}")

    def arch(self, policy: MoEArch) -> MoEArch:
        """The critic's architecture: the policy's with the fields of `model` replaced."""
        return dataclasses.replace(policy, **self.model) if self.model else policy

    def optim(self, policy: OptimConfig) -> OptimConfig:
        """The critic's optimizer: the policy's (`optim`) with lr, min_lr, clip_grad replaced."""
        lr = policy.lr if self.lr is None else self.lr
        min_lr = min(policy.min_lr, lr) if self.min_lr is None else self.min_lr
        clip = policy.clip_grad if self.clip_grad is None else self.clip_grad
        return dataclasses.replace(policy, lr=lr, min_lr=min_lr, clip_grad=clip)
