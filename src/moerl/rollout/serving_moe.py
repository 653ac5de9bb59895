"""An MoE layer in a serving step: Megatron's router and token dispatcher, the experts' own
weights.

Routing is the layer's `TopKRouter` (score function, expert bias, group-limited top-k,
scaling; the routing capture's hooks see it), so a token reaches the experts the trainer's
forward sends it to. On one rank the chosen (token, expert) pairs are sorted by expert
and each expert runs on its tokens; across expert-parallel ranks the layer's own
dispatcher moves them (`dispatch_preprocess`, the all-to-all of `token_dispatch`, ...,
`token_combine`), so every rank of the group must run the layer at every step, with
whatever tokens it has. Each expert is a `LeanMLP` (`lean_modules`). Layouts this path
does not cover (tensor-parallel attention feeding the MoE, grouped-GEMM experts, gated
shared experts, latent MoE, ...) run the Megatron layer whole.
"""

from __future__ import annotations

from typing import Any

import torch

from moerl.rollout.expert_stack import ExpertStack, stackable
from moerl.rollout.lean_modules import LeanMLP, project

# Up to this many tokens x (experts / top-k), a step runs every local expert on every
# token (`expert_stack`); beyond, each expert on its own tokens.
_STACK_TOKENS = 64


def _lean_experts(moe: Any) -> list[LeanMLP] | None:
    from megatron.core.transformer.moe.experts import SequentialMLP

    if type(moe.experts) is not SequentialMLP:
        return None
    experts = [LeanMLP(expert) for expert in moe.experts.local_experts]
    return experts if all(e.fast for e in experts) else None


class ServingMoE:
    """One `MoELayer`, called as `mlp(x)` is: [T, 1, H] -> [T, 1, H]."""

    def __init__(self, moe: Any) -> None:
        config = moe.config
        self.moe = moe
        self.experts = _lean_experts(moe)
        self.shared = LeanMLP(moe.shared_experts) if moe.use_shared_expert else None
        self.lean = (self.experts is not None
                     and (self.shared is None or self.shared.fast)
                     and moe.tp_group.size() == 1
                     and not config.moe_apply_probs_on_input
                     and not getattr(config, "moe_latent_size", None))
        self.one_rank = moe.ep_group.size() == 1 and (config.expert_tensor_parallel_size or 1) == 1
        self.stack = None
        if self.lean and self.one_rank and stackable(moe.experts.local_experts, config):
            self.stack = ExpertStack(list(moe.experts.local_experts), moe.shared_experts
                                     if moe.use_shared_expert else None, config.activation_func)
        self.stack_tokens = _STACK_TOKENS * config.moe_router_topk // max(1, config.num_moe_experts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.lean:
            return project(self.moe, x)
        tokens, width = x.shape[0], x.shape[-1]
        probs, routing_map = self.moe.router(x)  # [T, E] each (probs zero off the top-k)
        shared_done = False
        if self.stack is not None and tokens <= self.stack_tokens:
            out = self.stack(x.view(tokens, width), probs).view_as(x)
            shared_done = self.stack.has_shared
        elif self.one_rank:
            out = self._local(x.view(tokens, width), probs, routing_map).view_as(x)
        else:
            out = self._dispatched(x, probs, routing_map)
        if self.shared is not None and not shared_done:
            out = out + self.shared(x)
        return out

    def _run_experts(self, tokens: torch.Tensor, weights: torch.Tensor,
                     counts: list[int]) -> torch.Tensor:
        """tokens [N, H] sorted by local expert, `counts` per expert -> outputs [N, H]."""
        assert self.experts is not None
        outs = []
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                end = start + count
                outs.append(expert(tokens[start:end], weights[start:end]))
                start = end
        if not outs:  # no token reached this rank's experts
            return tokens[:0]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _local(self, hidden: torch.Tensor, probs: torch.Tensor,
               routing_map: torch.Tensor) -> torch.Tensor:
        """Every expert on this rank: hidden [T, H] -> [T, H]."""
        token, expert = routing_map.nonzero(as_tuple=True)  # [T * top-k] each
        order = torch.argsort(expert, stable=True)
        token, expert = token[order], expert[order]
        counts = torch.bincount(expert, minlength=len(self.experts or ())).tolist()
        out = self._run_experts(hidden.index_select(0, token), probs[token, expert], counts)
        return torch.zeros_like(hidden).index_add_(0, token, out)

    def _dispatched(self, x: torch.Tensor, probs: torch.Tensor,
                    routing_map: torch.Tensor) -> torch.Tensor:
        """Through the layer's expert-parallel dispatcher: x [T, 1, H] -> [T, 1, H]."""
        dispatcher = self.moe.token_dispatcher
        tokens, weights = dispatcher.dispatch_preprocess(x, routing_map, probs)
        tokens, weights = dispatcher.token_dispatch(tokens, weights)
        tokens, per_expert, weights = dispatcher.dispatch_postprocess(tokens, weights)
        out = self._run_experts(tokens, weights, [int(n) for n in per_expert.tolist()])
        out = dispatcher.token_combine(dispatcher.combine_preprocess(out))
        return dispatcher.combine_postprocess(out)
