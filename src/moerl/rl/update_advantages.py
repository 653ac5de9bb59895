"""Per-token advantages that need the update's own forwards, over one step's minibatches.

The loop's `update` (rl/loop.py) prepares every minibatch of the step first (its
micro-batches, pi_old and reference logprobs, the global `Denominator`: a `Prepared`
each); then

  * reinforce_pp: `reinforce_pp_step` turns the samples' rewards into REINFORCE++
    advantages whitened over the whole step (rl/token_returns.py);
  * gae: given the critic's values of every micro-batch (before it moves), `gae_step`
    computes GAE advantages and value targets over the whole step
    (rl/gae_returns.py); `critic_steps` then takes one critic step per minibatch on
    them (rl/critic.py).

Both advantage steps replace each micro-batch's `advantages` with the (B, T) per-token
ones and return the step's metrics. `sat_out` gives the metrics of a step the policy
does not train (the critic's warm-up).
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


def gae_step(prepared: Sequence[Prepared], parts: Sequence[Sequence[RLSample]],
             values: Sequence[Sequence[torch.Tensor]], cfg: RLConfig,
             group: dist.ProcessGroup | None
             ) -> tuple[list[Prepared], list[list[torch.Tensor]], dict[str, float]]:
    """GAE advantages over the whole step (`rl.gae_returns`): (`prepared` with them, the
    critic's targets per minibatch, the metrics). `parts[i]`: minibatch i's samples, which
    its micro-batches were packed from; `values[i]`: the critic's values of them, (B, T)
    per micro-batch."""
    from moerl.rl.gae_returns import gae_advantages, row_rewards

    micro, old, ref = flat(prepared)
    rewards = [row_rewards(mb, part) for p, part in zip(prepared, parts, strict=True)
               for mb in p.micro]  # fmt: skip
    new, returns, metrics = gae_advantages(
        micro, [v for per in values for v in per], rewards, old, ref, cfg.kl_in_reward,
        cfg.gae_gamma, cfg.gae_lambda, group)
    targets = iter(returns)
    per_part = [[next(targets) for _ in p.micro] for p in prepared]
    return _regroup(prepared, new), per_part, metrics


def critic_steps(critic: Critic, prepared: Sequence[Prepared],
                 values: Sequence[Sequence[torch.Tensor]],
                 returns: Sequence[Sequence[torch.Tensor]]) -> dict[str, float]:
    """One critic step per minibatch (clip window around `values[i]`, targets
    `returns[i]`); its metrics averaged over the steps."""
    steps = [critic.update(p.micro, v, g, p.denom)
             for p, v, g in zip(prepared, values, returns, strict=True)]  # fmt: skip
    return {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]}


def sat_out(prepared: Sequence[Prepared]) -> dict[str, float]:
    """A step the policy sits out (the critic's warm-up): what it would have trained on,
    its loss tokens and sequences averaged over the minibatches."""
    return {key: sum(getattr(p.denom, attr) for p in prepared) / len(prepared)
            for key, attr in (("tokens", "num_tokens"), ("sequences", "num_seqs"))}
