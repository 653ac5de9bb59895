"""The models the RL loop drives, side by side: the policy, the frozen reference model
and, with `rl.advantage=gae`, PPO's critic.

    peers = Peers.build(arch, layout, optim, groups, cfg)
    prepared = peers.prepare(samples)   # packed by the policy, with pi_old and ref logprobs

None of them holds or changes another: the loop (rl/loop.py `update`) asks each for what
it computes and trains the critic and the policy in turn. `updates` counts the loop's
updates (the critic's warm-up is counted in them); a resume restores it (rl/resume.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moerl.data.rl_batch import RLSample
from moerl.models.arch import MoEArch
from moerl.models.precision import RecomputeConfig, ResolvedPrecision
from moerl.parallel.groups import ParallelGroups
from moerl.parallel.layout import ParallelLayout
from moerl.rl.config import RLConfig
from moerl.rl.critic import Critic
from moerl.rl.policy import Policy
from moerl.rl.reference import Reference
from moerl.rl.update_advantages import Prepared
from moerl.trainer.config import OptimConfig
from moerl.trainer.optimizer import Trainable


@dataclass
class Peers:
    """The policy, its optional reference model and critic, and the updates so far."""

    policy: Policy
    reference: Reference | None = None
    critic: Critic | None = None
    updates: int = 0

    @classmethod
    def build(
        cls,
        arch: MoEArch,
        layout: ParallelLayout,
        optim: OptimConfig,
        groups: ParallelGroups,
        cfg: RLConfig,
        weights: str | Path | None = None,
        reference_weights: str | Path | None = None,
        precision: ResolvedPrecision | None = None,
        recompute: RecomputeConfig | None = None,
    ) -> Peers:
        """The policy (from `weights` if given); with `rl.use_reference` the reference
        model, read from `reference_weights` or else a copy of the initial policy; with
        `rl.advantage=gae` the critic (`rl.critic`, its head drawn from `rl.seed`), which
        starts from the policy's weights unless `rl.critic.init_from_policy` is false."""
        policy = Policy.build(arch, layout, optim, groups, cfg, weights=weights,
                              precision=precision, recompute=recompute)
        reference = (Reference.build(arch, layout, groups, cfg, initial=policy.chunks,
                                     weights=reference_weights, precision=precision)
                     if cfg.use_reference else None)
        critic = (Critic.build(arch, layout, optim, groups, cfg.critic, init_from=policy.chunks,
                               seed=cfg.seed, precision=precision, recompute=recompute)
                  if cfg.advantage == "gae" else None)
        return cls(policy, reference, critic)

    def prepare(self, samples: Sequence[RLSample], first: bool = True) -> Prepared:
        """One minibatch as the policy packs it, with its pi_old (`Policy.old_logprobs`;
        `first`: the step's first minibatch), the reference's logprobs (None without a
        reference) and the global denominator."""
        micro = self.policy.pack(samples)
        old = self.policy.old_logprobs(micro, first)
        ref = ([lp for lp, _ in self.reference.logprobs(micro)]
               if self.reference is not None else None)
        return Prepared(micro, old, ref, self.policy.denominator(micro))

    def need_critic(self) -> Critic:
        """The critic, which `rl.advantage=gae` needs."""
        if self.critic is None:
            raise ValueError("rl.advantage=gae needs a critic (Peers(critic=...))")
        return self.critic

    def checkpoint_parts(self) -> dict[str, Trainable]:
        """The trainables saved beside the policy's in each checkpoint, by name."""
        return {"critic": self.critic.trainable} if self.critic is not None else {}
