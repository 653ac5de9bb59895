"""The seam between the policy update and the objectives: inputs, protocol, metrics.

Every objective is called once per micro-batch with that micro-batch's tensors and the
global-batch `Denominator`, and returns (loss, metrics):

  * loss: a scalar, this micro-batch's share of the global-batch loss. Summed over all
    micro-batches and all data-parallel ranks it is the loss of the global batch, so
    the caller backpropagates it as is (no division by the number of micro-batches; if
    the DP gradient reduction averages rather than sums, scale by the DP size).
  * metrics: detached scalars. Keys ending in `_max` reduce by max across micro-batches
    and ranks; every other key is an additive share (already divided by the global
    count), so it reduces by sum to the global-batch value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from moerl.rl.losses.aggregation import Denominator

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PolicyLossInputs:
    """One micro-batch, B sequences padded to T tokens."""

    logprobs: torch.Tensor
    """(B, T) log pi_theta(y_t) of the current policy; carries the gradient."""
    old_logprobs: torch.Tensor
    """(B, T) log pi_old(y_t): the trainer's logprobs before this step's updates."""
    advantages: torch.Tensor
    """(B,) per sequence or (B, T) per token."""
    loss_mask: torch.Tensor
    """(B, T) 1 on generated tokens that carry loss; 0 on prompt, environment, padding."""
    rollout_logprobs: torch.Tensor | None = None
    """(B, T) logprobs the rollout engine reported; needed for IS correction."""
    ref_logprobs: torch.Tensor | None = None
    """(B, T) reference-policy logprobs; needed for a KL term."""
    entropy: torch.Tensor | None = None
    """(B, T) per-token entropy of the current policy; needed for an entropy bonus."""
    token_versions: torch.Tensor | None = None
    """(B, T) int64 weight version that sampled each token (partial rollouts: two in one
    sequence); the IS correction reports them."""

    def __post_init__(self) -> None:
        shape = self.logprobs.shape
        if self.logprobs.dim() != 2:
            raise ValueError(f"logprobs must be (B, T), got {tuple(shape)}")
        for name in ("old_logprobs", "loss_mask", "rollout_logprobs", "ref_logprobs", "entropy",
                     "token_versions"):
            t = getattr(self, name)
            if t is not None and t.shape != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs {tuple(shape)}")
        adv = self.advantages.shape
        if adv != shape and adv != shape[:1]:
            raise ValueError(
                f"advantages must be (B,) or (B, T) = {tuple(shape)}, got {tuple(adv)}"
            )

    def zero_masked(self) -> PolicyLossInputs:
        """A copy with every (B, T) tensor set to 0 where loss_mask is 0.

        Padding may hold anything (inf, nan, a stale logprob). Masking only the final
        sum is not enough: a nan upstream of exp() turns its zero gradient into nan.
        torch.where passes no gradient to the replaced entries, so this is safe.
        """
        keep = self.loss_mask.bool()

        def zero(t: torch.Tensor) -> torch.Tensor:
            return torch.where(keep, t, torch.zeros_like(t))

        def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else zero(t)

        adv = self.advantages
        return PolicyLossInputs(
            logprobs=zero(self.logprobs),
            old_logprobs=zero(self.old_logprobs),
            advantages=adv if adv.dim() == 1 else zero(adv),
            loss_mask=self.loss_mask,
            rollout_logprobs=maybe(self.rollout_logprobs),
            ref_logprobs=maybe(self.ref_logprobs),
            entropy=maybe(self.entropy),
            token_versions=self.token_versions,
        )

    def token_advantages(self) -> torch.Tensor:
        """(B, T) advantages, sequence advantages broadcast along T; no gradient."""
        adv = self.advantages.detach().to(self.logprobs.dtype)
        if adv.dim() == 1:
            adv = adv[:, None].expand_as(self.logprobs)
        return adv


class PolicyObjective(Protocol):
    """A policy-gradient objective: one micro-batch in, (loss, metrics) out."""

    def __call__(
        self, inputs: PolicyLossInputs, denom: Denominator
    ) -> tuple[torch.Tensor, Metrics]: ...
