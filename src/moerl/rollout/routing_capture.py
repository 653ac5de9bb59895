"""The experts the engine's MoE layers chose, captured per position for the trainer's
routing replay (`SamplingParams.return_routed_experts`, `rl.routing_replay`).

Forward hooks on the model's decoder routers keep, while capturing is on, each router's
top-k expert ids of the last forward: (tokens, top-k), the tokens s-major as the router
sees them (position-major, then batch row). The static decoder hands them to its rows
after every forward (`static_decode`), so a row collects the experts of every position
it fed: its prompt and its generated tokens but the last.
"""

from __future__ import annotations

from typing import Any

import torch

from moerl.models.routers import decoder_routers, top_k_ids
from moerl.rollout.types import RoutedExperts


class RoutingCapture:
    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = dict(sorted(decoder_routers([model]).items()))
        self.topk = int(next(iter(self.routers.values())).topk) if self.routers else 0
        self.num_experts = int(next(iter(self.routers.values())).config.num_moe_experts
                               ) if self.routers else 0
        self.on = False
        self._last: dict[int, torch.Tensor] = {}
        for number, router in self.routers.items():
            router.register_forward_hook(self._hook(number))

    def _hook(self, number: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self.on:
                self._last[number] = top_k_ids(output[1].detach(), self.topk).cpu()

        return hook

    def take(self, positions: int, rows: int) -> torch.Tensor:
        """(MoE layers, positions, rows, top-k) of the last forward, which ran `rows`
        sequences over `positions` positions each."""
        missing = [n for n in self.routers if n not in self._last]
        if missing:
            raise RuntimeError(f"no routing captured for MoE layers {missing}")
        ids = torch.stack([self._last[n] for n in self.routers])  # (L, s * k, topk)
        self._last.clear()
        return ids.reshape(len(self.routers), positions, rows, self.topk)

    def take_tokens(self) -> torch.Tensor:
        """(MoE layers, tokens, top-k) of the last forward, its tokens in the order fed."""
        missing = [n for n in self.routers if n not in self._last]
        if missing:
            raise RuntimeError(f"no routing captured for MoE layers {missing}")
        ids = torch.stack([self._last[n] for n in self.routers])  # (L, T, topk)
        self._last.clear()
        return ids

    def pack(self, per_forward: list[torch.Tensor]) -> RoutedExperts:
        """One row's captures, (L, s_i, top-k) each in position order, as the wire form."""
        ids = torch.cat(per_forward, dim=1)
        dtype = torch.uint8 if self.num_experts <= 256 else torch.int16
        layers, positions, topk = ids.shape
        return RoutedExperts((layers, positions, topk),
                             ids.to(dtype).contiguous().numpy().tobytes())
