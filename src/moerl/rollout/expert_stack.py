"""Every local expert at once, for steps of few tokens (decoding).

A decode step routes a handful of tokens; running each chosen expert on its two or three
tokens costs a dozen small ops per expert. Instead every expert runs on every token as
one batched matmul pair over the experts' weights stacked [E, H, 2F] and [E, F, H],
each output weighted by the token's routing probability (zero for an expert it did not
choose) and summed over experts: E / top-k times the FLOPs of the chosen experts alone,
in ten ops whatever E is. A shared expert of the same width joins the stack with weight
one. Past `max_tokens` x top-k / E tokens the chosen-experts path is cheaper and is used.

The stacks are copies of the experts' weights, refreshed when any source weight changes
(another tensor, or the same one written in place: `data_ptr` and `_version`), so weight
updates reach them before the next step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _weights(mlp: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return mlp.linear_fc1.weight, mlp.linear_fc2.weight


class ExpertStack:
    """The local experts' (and a same-width shared expert's) weights, stacked."""

    def __init__(self, experts: list[Any], shared: Any | None, activation: Any) -> None:
        first = _weights(experts[0])
        fits = shared is not None and all(
            a.shape == b.shape for a, b in zip(_weights(shared), first, strict=True))
        self.sources = [*experts, *([shared] if fits else [])]
        self.has_shared = fits
        self.activation = activation
        self._key: tuple[int, ...] = ()
        self.fc1 = self.fc2 = torch.empty(0)

    def _refresh(self) -> None:
        weights = [w for mlp in self.sources for w in _weights(mlp)]
        key = tuple(x for w in weights for x in (w.data_ptr(), w._version))
        if key != self._key:
            with torch.no_grad():
                # [E, H, 2F] and [E, F, H]: tokens [E, T, H] @ fc1 -> [E, T, 2F]
                self.fc1 = torch.stack([w.t() for w in weights[0::2]]).contiguous()
                self.fc2 = torch.stack([w.t() for w in weights[1::2]]).contiguous()
            self._key = key

    def __call__(self, hidden: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], probs [T, E] (zero off each token's top-k) -> the routed experts'
        weighted sum [T, H], plus the shared expert when it is stacked."""
        self._refresh()
        tokens, width = hidden.shape
        weight = probs.t()  # [E, T]
        if self.has_shared:
            weight = torch.cat([weight, weight.new_ones(1, tokens)])
        up = torch.bmm(hidden.expand(len(self.sources), tokens, width), self.fc1)
        gate, linear = up.chunk(2, dim=-1)  # [E, T, F] each
        act = (self.activation(gate) * linear * weight.unsqueeze(-1)).to(hidden.dtype)
        return torch.bmm(act, self.fc2).sum(0)  # [T, H]


def stackable(experts: list[Any], config: Any) -> bool:
    """Plain gated SiLU experts (no clamp, no offset), as `ExpertStack` computes them."""
    return (config.gated_linear_unit and config.activation_func is F.silu
            and getattr(config, "activation_func_clamp_value", None) is None
            and not getattr(config, "glu_linear_offset", 0.0) and len(experts) > 0)
