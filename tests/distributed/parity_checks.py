"""Whole-model comparisons for the parity workers, whatever the layout.

Gradients and weights are compared parameter by parameter through layout-free
weights checkpoints (`models.weights`): `save_gradients` writes every parameter's
gradient as if it were the weights, and `compare_with_checkpoint` loads such a
checkpoint into another layout's model (resharded on load) and compares it with that
rank's own tensors, so every shard of every parameter (TP, EP, PP, VPP) is compared
with the one-process values without gathering anything by hand.

`RoutingMargins` records how close the router's top-k choices came to a tie: a
choice decided by less than fp32 noise could flip between layouts and make a correct
layout differ from the reference by a whole token's routing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moerl.trainer.config import OptimConfig

Tensors = dict[str, torch.Tensor]

# Adam with eps above the gradient entries: its update g / (|g| + eps) then has slope
# at most 1/eps in g, so fp32 rounding differences of the gradient (summation order
# differs between layouts) stay rounding-sized in the weights. With the default 1e-8
# the slope is 1e8 for near-zero entries: one Adam step turned a 5e-9 gradient
# difference into a 1.6e-4 weight difference, and two steps later a routing near-tie
# flipped (see test_parity.py).
PARITY_OPTIM = OptimConfig(lr=1e-2, adam_eps=1e-3, clip_grad=1.0)
# Routing scores (sigmoid, ~0.5) differed between one process and DP2 or TP2 by at most
# 1.2e-7 (2 ulp) under PARITY_OPTIM; a top-k choice decided by 80x that cannot flip.
MARGIN_FLOOR = 1e-5


def _modules(model: list[Any]) -> list[torch.nn.Module]:
    from moerl.models.weights import unwrap_model

    return [unwrap_model(chunk) for chunk in model]


def gather_grad_shards(model: list[Any]) -> None:
    """Make `main_grad` hold the whole reduced gradient on every data-parallel rank.

    With the distributed optimizer the gradient buffers are reduce-scattered: each
    rank holds the reduced values only in its own shard of every bucket (the rest is
    its local partial sum). All-gathering the shards fixes that; the optimizer reads
    only its own shard, so the step is unchanged. A no-op without the distributed
    optimizer (the buffers are all-reduced).
    """
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in model:
        if not chunk.ddp_config.use_distributed_optimizer:
            continue
        for group in [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]:
            size = group.intra_distributed_optimizer_instance_size
            if size == 1:
                continue
            rank = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                shards = list(shard_buffer(bucket.grad_data, size))
                dist.all_gather(shards, shards[rank].clone(),
                                group=group.intra_distributed_optimizer_instance_group)


def own_gradients(model: list[Any]) -> Tensors:
    """This rank's whole reduced gradient of every parameter (copies), by local name."""
    gather_grad_shards(model)
    return {f"{i}.{name}": p.main_grad.detach().clone()  # type: ignore[attr-defined]
            for i, chunk in enumerate(_modules(model)) for name, p in chunk.named_parameters()}


def own_state(model: list[Any]) -> Tensors:
    """Copies of every floating-point tensor of the model state (weights and buffers
    such as the router's expert bias), by local name."""
    return {f"{i}.{name}": t.detach().clone()
            for i, chunk in enumerate(_modules(model))
            for name, t in chunk.state_dict().items()
            if torch.is_tensor(t) and t.is_floating_point()}


@contextmanager
def state_kept(model: list[Any]) -> Iterator[None]:
    """Put the model's whole state (weights and buffers) back after the block."""
    kept = [{k: v.clone() if torch.is_tensor(v) else v for k, v in chunk.state_dict().items()}
            for chunk in _modules(model)]
    try:
        yield
    finally:
        for chunk, state in zip(_modules(model), kept, strict=True):
            chunk.load_state_dict(state, strict=True)


def record_gradients(optimizer: Any, model: list[Any]) -> list[Tensors]:
    """Make every `optimizer.step()` first record the whole gradient of every
    parameter (before clipping); returns the list it appends one dict per step to."""
    recorded: list[Tensors] = []
    step = optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        recorded.append(own_gradients(model))
        return step(*args, **kwargs)

    optimizer.step = recording_step
    return recorded


def save_as_weights(model: list[Any], tensors: Tensors, directory: Path) -> None:
    """Write `tensors` (one per parameter, by `own_gradients` names) as if they were the
    weights, all ranks together; the model's own weights are left as they were."""
    from moerl.models.weights import save_weights

    with state_kept(model), torch.no_grad():
        for i, chunk in enumerate(_modules(model)):
            for name, p in chunk.named_parameters():
                p.copy_(tensors[f"{i}.{name}"])
        save_weights(model, directory)


def save_gradients(model: list[Any], directory: Path) -> None:
    """Write every parameter's whole gradient as if it were the weights: loading the
    directory under any layout gives each parameter's gradient."""
    save_as_weights(model, own_gradients(model), directory)


def compare_with_checkpoint(model: list[Any], directory: Path, own: Tensors) -> dict[str, Any]:
    """Load `directory` (weights, or gradients from `save_gradients`) into this
    layout's model and compare it with `own` (from `own_gradients` or `own_state`),
    tensor by tensor, on every rank; the model's state is left as it was.

    Returns, merged over all ranks: per tensor (local name with the rank's place) the
    largest absolute difference relative to the largest entry of the reference tensor,
    and the worst of them.
    """
    from moerl.models.weights import load_weights

    with state_kept(model):
        load_weights(model, directory)
        reference = own_state(model)
    place = _place()
    rows = {f"{name} [{place}]": _relative_diff(reference[name], mine)
            for name, mine in own.items()}
    merged: dict[str, float] = {}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    for part in gathered:  # ranks that share a place (CP, expert-DP) hold the same tensors
        for key, value in part.items():
            merged[key] = max(value, merged.get(key, 0.0))
    worst = max(merged, key=lambda k: merged[k])
    return {"relative": merged, "worst": worst, "worst_value": merged[worst],
            "tensors": len(merged)}


def _relative_diff(reference: torch.Tensor, mine: torch.Tensor) -> float:
    diff = float((reference.double() - mine.double()).abs().max())
    scale = float(reference.abs().max())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def _place() -> str:
    from megatron.core import parallel_state as ps

    return (f"pp{ps.get_pipeline_model_parallel_rank()} tp{ps.get_tensor_model_parallel_rank()}"
            f" ep{ps.get_expert_model_parallel_rank()} cp{ps.get_context_parallel_rank()}"
            f" dp{ps.get_data_parallel_rank()}")


class RoutingMargins:
    """The smallest gap, over every token routed while installed, between the k-th and
    (k+1)-th score of the router's top-k choices: with the expert bias (the experts a
    token goes to) and without it (the choices the load-balancing loss counts)."""

    def __init__(self) -> None:
        self.smallest = math.inf
        self._original: Callable[..., Any] | None = None

    def install(self) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        original = TopKRouter.routing
        margins = self

        def routing(router: Any, logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if router.training:
                margins.record(router, logits)
            return original(router, logits, *args, **kwargs)

        self._original = original
        TopKRouter.routing = routing

    def record(self, router: Any, logits: torch.Tensor) -> None:
        config = router.config
        groups = config.moe_router_num_groups
        if router.score_function != "sigmoid" or (groups and config.moe_router_group_topk < groups):
            # Softmax scores and group-limited choices have other decision boundaries.
            raise NotImplementedError("margins are computed for sigmoid routers over all groups")
        with torch.no_grad():
            scores = torch.sigmoid(logits.float().reshape(-1, logits.shape[-1]))
            candidates = [scores]
            if router.expert_bias is not None:
                candidates.append(scores + router.expert_bias.float())
            for values in candidates:
                top = values.topk(router.topk + 1, dim=-1).values
                gap = float((top[:, router.topk - 1] - top[:, router.topk]).min())
                self.smallest = min(self.smallest, gap)

    def global_smallest(self) -> float:
        value = torch.tensor([self.smallest], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return float(value)
