"""The bytes a built model and optimizer hold, term by term, read off the objects themselves.

The same count serves a run that really allocates (tests/distributed/memory_worker.py
measures one) and a rehearsal on tensors that hold no memory (`moerl rehearse`):

    weights              every parameter: numel x element size (`weight_width` may say
                         otherwise for one, e.g. FP8 primary weights built as bf16)
    main_grads           each parameter's `main_grad`, a view into Megatron DDP's fp32
                         gradient buffers: numel x 4
    grad_buffer_padding  what those buffers hold beyond the views (bucket alignment)
    master_weights       fp32 copies the optimizer keeps of bf16 parameters (its shard)
    adam_states          exp_avg and exp_avg_sq of the optimizer's parameters (its shard)

Adam makes its moments at its first step; `init_optimizer_state` makes them before
one, with the function Megatron itself calls before loading a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

WeightWidth = Callable[[str, torch.nn.Parameter], int]
"""(parameter name, parameter) -> bytes per element it is held in."""


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def init_optimizer_state(optimizer: Any) -> None:
    """Adam's moments for every parameter, as Megatron makes them before a checkpoint
    load (`init_state_fn`); parameters that have them already are left alone."""
    for opt in _inner_optimizers(optimizer):
        if opt.init_state_fn is not None:
            opt.init_state_fn(opt.optimizer, opt.config)


def optimizer_bytes(optimizer: Any) -> dict[str, int]:
    """master_weights and adam_states held by this rank's optimizer(s)."""
    master = adam = 0
    for opt in _inner_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            adam += sum(v.numel() * v.element_size() for k, v in state.items()
                        if k != "step" and torch.is_tensor(v))
        # Float16OptimizerWithFloat16Params / DistributedOptimizer keep fp32 copies
        # of bf16 parameters; fp32 parameters are optimized in place (no copy).
        groups = getattr(opt, "shard_fp32_from_float16_groups", None)
        if groups is None:
            groups = getattr(opt, "fp32_from_float16_groups", [])
        master += sum(p.numel() * p.element_size() for group in groups for p in group)
    return {"master_weights": master, "adam_states": adam}


def weight_bytes(chunks: Iterable[torch.nn.Module], weight_width: WeightWidth | None = None
                 ) -> int:
    """Bytes of the parameters of `chunks` (each counted once)."""
    seen: set[int] = set()
    total = 0
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            width = weight_width(name, p) if weight_width is not None else p.element_size()
            total += p.numel() * width
    return total


def trainable_bytes(model: list[Any], optimizer: Any,
                    weight_width: WeightWidth | None = None) -> dict[str, int]:
    """Every term above for Megatron DDP chunks `model` and their optimizer."""
    modules = [chunk.module for chunk in model]
    params = {id(p): p for chunk in modules for p in chunk.parameters()}
    grads = sum(p.main_grad.numel() * p.main_grad.element_size() for p in params.values())
    buffers = sum(buf.grad_data.numel() * buf.grad_data.element_size()
                  for chunk in model for buf in chunk.buffers + chunk.expert_parallel_buffers)
    return {
        "weights": weight_bytes(modules, weight_width),
        "main_grads": grads,
        "grad_buffer_padding": buffers - grads,
        **optimizer_bytes(optimizer),
    }
