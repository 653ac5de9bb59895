"""Per-token advantages that need the update's own forwards, over one step's minibatches.

`Policy.update` prepares every minibatch of the step first (its micro-batches, pi_old
and reference logprobs, the global `Denominator`: a `Prepared` each); then

  * reinforce_pp: `reinforce_pp_step` turns the samples' rewards into REINFORCE++
    advantages whitened over the whole step (rl/token_returns.py);
  * gae: `gae_step` asks the critic for its values of every micro-batch (before it
    moves), computes GAE advantages and value targets over the whole step
    (rl/gae_returns.py) and takes one critic step per minibatch on them
    (rl/critic.py).

Both replace each micro-batch's `advantages` with the (B, T) per-token ones and return
the step's metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moerl.data.rl_batch import RLMicroBatch, RLSample
from moerl.rl.config import RLConfig
from moerl.rl.losses import Denominator

if TYPE_CHECKING:
    from moerl.rl.critic import Critic


@dataclass
class Prepared:
    """One optimizer step's micro-batches with everything the loss needs."""

    micro: list[RLMicroBatch]
    old: list[torch.Tensor] | None  # (B, T) each; None: the update's own forward, detached
    ref: list[torch.Tensor] | None
    denom: Denominator


def flat(prepared: Sequence[Prepared]) -> tuple[list[RLMicroBatch], list[torch.Tensor | None],
                                               list[torch.Tensor | None]]:
    """The step's micro-batches with their pi_old and reference logprobs (None: none)."""
    micro = [mb for p in prepared for mb in p.micro]
    old = [p.old[k] if p.old is not None else None
           for p in prepared for k in range(len(p.micro))]  # fmt: skip
    ref = [p.ref[k] if p.ref is not None else None
           for p in prepared for k in range(len(p.micro))]  # fmt: skip
    return micro, old, ref


def _regroup(prepared: Sequence[Prepared], micro: Sequence[RLMicroBatch]) -> list[Prepared]:
    """`prepared` with its micro-batches replaced, in order, by `micro`."""
    batches = iter(micro)
    return [replace(p, micro=[next(batches) for _ in p.micro]) for p in prepared]


def reinforce_pp_step(prepared: Sequence[Prepared], kl_coef: float,
                      group: dist.ProcessGroup | None) -> tuple[list[Prepared], dict[str, float]]:
    """Per-token REINFORCE++ advantages over the whole step (`rl.token_returns`)."""
    from moerl.rl.token_returns import reinforce_pp

    micro, old, ref = flat(prepared)
    new, metrics = reinforce_pp(micro, old, ref, kl_coef, 1.0, group)
    return _regroup(prepared, new), metrics


def gae_step(prepared: Sequence[Prepared], parts: Sequence[Sequence[RLSample]], critic: Critic,
             cfg: RLConfig, group: dist.ProcessGroup | None
             ) -> tuple[list[Prepared], dict[str, float]]:
    """GAE advantages from the critic's values over the whole step (`rl.gae_returns`),
    then one critic step per minibatch (`parts[i]`: minibatch i's samples, which its
    micro-batches were packed from); the metrics of both (critic metrics averaged over
    its steps)."""
    from moerl.rl.gae_returns import gae_advantages, row_rewards

    values = [critic.values(p.micro) for p in prepared]  # V_old: before the critic moves
    micro, old, ref = flat(prepared)
    rewards = [row_rewards(mb, part) for p, part in zip(prepared, parts, strict=True)
               for mb in p.micro]  # fmt: skip
    new, returns, metrics = gae_advantages(
        micro, [v for per in values for v in per], rewards, old, ref, cfg.kl_in_reward,
        cfg.gae_gamma, cfg.gae_lambda, group)
    targets = iter(returns)
    steps = [critic.update(p.micro, v, [next(targets) for _ in v], p.denom)
             for p, v in zip(prepared, values, strict=True)]  # fmt: skip
    critic_metrics = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]}
    return _regroup(prepared, new), {**metrics, **critic_metrics}
