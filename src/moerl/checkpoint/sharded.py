"""Model and optimizer state through Megatron's `dist_checkpointing`, resharding on load.

Model tensors are stored by global name and offset, so they load under any
TP/PP/VPP/EP layout (the same state dict as `moerl.models.weights`, whose files
this part of a checkpoint is).

The distributed optimizer's state is saved in one of two Megatron formats
(`checkpoint.optimizer_format`):

- "dp_reshardable" (the default, Megatron-LM's): each rank's shard of the fp32
  master weights and Adam moments as the flat bucket slices it holds, written
  as they are, with no gather and no copy. It reshards across data (and context)
  parallelism only: TP, PP, VPP, EP and expert-TP must be the saving run's.
- "fully_reshardable": every moment in the shape of its parameter, which
  reshards across TP, PP, DP and EP>1 changes, but the save gathers each
  parameter's state on its first data-parallel rank (host memory that grows
  with the model, not with the rank's shard): a save to take once, before a
  layout change.

Neither maps across EP=1 <-> EP>1 (the expert parameters move to a second
optimizer) or between the distributed and the plain optimizer (whose state
Megatron keys by parameter, under any TP/PP). `check_optimizer_compatible`
refuses what cannot be loaded, naming the way out, instead of failing deep
inside the load.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from moerl.checkpoint.config import CheckpointError
from moerl.checkpoint.trainable import Trainable
from moerl.models.weights import sharded_model_state, unwrap_model

OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable")
# What checkpoints written before the format was recorded hold.
_LEGACY_FORMAT = "fully_reshardable"


def optimizer_metadata(fmt: str) -> dict[str, Any]:
    """Megatron's `sharded_state_dict` metadata for optimizer format `fmt`."""
    if fmt not in OPTIMIZER_FORMATS:
        raise ValueError(f"checkpoint.optimizer_format: {fmt!r}; choose one of "
                         f"{', '.join(OPTIMIZER_FORMATS)}")
    return {"distrib_optim_sharding_type": fmt, "chained_optim_avoid_prefix": True}


def model_parallel_layout() -> dict[str, int]:
    """The degrees a dp_reshardable optimizer checkpoint is tied to."""
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
    }


def _parts(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_facts(trainable: Trainable, fmt: str) -> dict[str, Any]:
    """What decides whether saved optimizer state can be loaded into this one
    (`fmt`: the format this run saves in)."""
    parts = _parts(trainable.optimizer)
    distributed = any(isinstance(p, DistributedOptimizer) for p in parts)
    steps = [int(s["step"]) for p in parts if p.optimizer is not None
             for s in p.optimizer.state.values() if "step" in s]
    return {
        "kind": "distributed" if distributed else "plain",
        "ep": ps.get_expert_model_parallel_world_size(),
        "step": max(steps, default=0),  # Adam's bias-correction count
        "format": fmt,
        "layout": model_parallel_layout(),
    }


def saved_format(saved: dict[str, Any]) -> str:
    return str(saved.get("format", _LEGACY_FORMAT))


def _describe(layout: dict[str, int]) -> str:
    return " ".join(f"{k.upper()}{v}" for k, v in layout.items())


def check_optimizer_compatible(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Refuse the optimizer changes megatron-core cannot reshard, naming the way out."""
    fix = ("Resume with checkpoint.weights_only=true to load the model weights, step, "
           "data position and RNG and start the optimizer state fresh, or resume under "
           "a layout that keeps them.")
    if saved["kind"] != now["kind"]:
        raise CheckpointError(
            f"optimizer state was saved by the {saved['kind']} optimizer and this run uses "
            f"the {now['kind']} one; megatron-core cannot convert between them. {fix} "
            "(parallel.use_distributed_optimizer / optim.use_distributed_optimizer)"
        )
    if (saved["ep"] > 1) != (now["ep"] > 1):
        raise CheckpointError(
            f"optimizer state was saved at EP={saved['ep']} and this run has "
            f"EP={now['ep']}; megatron-core reshards optimizer state between EP>1 layouts "
            f"but not between EP=1 and EP>1. {fix}"
        )
    layout = saved.get("layout")
    if (now["kind"] == "distributed" and saved_format(saved) == "dp_reshardable"
            and layout is not None and layout != now["layout"]):
        raise CheckpointError(
            f"optimizer state was saved in Megatron's dp_reshardable format at "
            f"{_describe(layout)} and this run has {_describe(now['layout'])}; that format "
            "reshards across data and context parallelism only. Resume at the saved TP, PP, "
            "VPP, EP and expert-TP (any DP), or with checkpoint.weights_only=true to start "
            "the optimizer fresh; to carry the optimizer across the change, save once at the "
            "old layout with checkpoint.optimizer_format=fully_reshardable, then resume "
            "from that checkpoint."
        )


def _materialize_adam_state(optimizer: Any) -> None:
    """Give every parameter its Adam state before a load or a save.

    torch's Adam creates `exp_avg`, `exp_avg_sq` and `step` lazily on its first
    step, and Megatron builds the sharded state from the state that exists: a
    fresh optimizer would load nothing, and a save before the first step (a run
    whose steps have had nothing to train yet) would fail. One step with zero
    gradients at lr=0 creates it without moving any parameter (the decoupled
    weight decay is scaled by lr too); the moments it leaves are zero, and `step`
    is set back to 0, which is exactly the state Adam's first real step starts
    from. A load then overwrites it.
    """
    for part in _parts(optimizer):
        inner = part.optimizer
        if inner is None or all(len(inner.state[p]) for g in inner.param_groups
                                for p in g["params"]):
            continue
        saved_lr = [g["lr"] for g in inner.param_groups]
        for group in inner.param_groups:
            group["lr"] = 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
        for group, lr in zip(inner.param_groups, saved_lr, strict=True):
            group["lr"] = lr
            for p in group["params"]:
                p.grad = None
                step = inner.state[p].get("step")
                if isinstance(step, torch.Tensor):
                    step.zero_()
                elif step is not None:
                    inner.state[p]["step"] = 0


def _load_optimizer_part(part: Any, state: dict[str, Any], step: int, fmt: str) -> None:
    """Load one (non-chained) Megatron optimizer from the tensors of `state`.

    Three things go wrong with torch's Adam (no Apex/TE) if this is left to
    `DistributedOptimizer.load_state_dict`: it hands one shared `step` tensor to
    every parameter, which Adam then increments once per parameter (the bias
    correction drifts and the resumed run is silently inexact); the
    fully_reshardable loader expects a saved tensor for every state entry,
    `step` included, which that format does not store (KeyError); and the
    non-tensor part (param groups, step) is stored in the saving layout's
    structure, one entry per optimizer part, which differs when the number of
    parts does (TP1 has one, TP2 a dense and an expert one). So the param groups
    are this optimizer's own, the step is the saved one, the moments load with
    `step` set aside, and each parameter gets its own `step` tensor back.
    (dp_reshardable does not store `step` either: its template keeps the local one.)
    """
    if not isinstance(part, DistributedOptimizer):
        part.load_state_dict(state)
    else:
        own = part.state_dict()  # allocated by the template build; groups of this layout
        for group in own["optimizer"]["param_groups"]:
            group["step"] = step
        part.load_state_dict(own)  # param groups and step; moments below
        inner = part.optimizer.state
        steps = {p: s.pop("step") for p, s in inner.items() if "step" in s}
        # The moments, as requested by this layout's template in the saved format.
        if fmt == "dp_reshardable":
            try:
                # fp32 models: the main params are views of the (leaf) weights
                with torch.no_grad():
                    part.load_parameter_state_from_dp_reshardable(state["param_state"])
            except AssertionError as err:  # Megatron's check of the bucket sizes
                raise CheckpointError(
                    f"optimizer state does not fit this run's distributed-optimizer buckets "
                    f"({err}); the model or its parallel layout differs from the saving "
                    "run's. Resume with checkpoint.weights_only=true, or at the saved "
                    "layout") from err
        else:
            part.load_parameter_state_from_fully_reshardable(state["param_state"])
        for p, shared in steps.items():
            inner[p]["step"] = shared
    for per_param in part.optimizer.state.values():
        if isinstance(per_param.get("step"), torch.Tensor):
            per_param["step"] = per_param["step"].detach().clone()


def _load_optimizer(optimizer: Any, state: Any, step: int, fmt: str) -> None:
    parts = _parts(optimizer)
    if len(parts) == 1:
        _load_optimizer_part(parts[0], state, step, fmt)
        return
    if not all(isinstance(p, DistributedOptimizer) for p in parts) or any(
        i not in state for i in range(len(parts))
    ):
        raise CheckpointError(
            f"optimizer state of the plain optimizer cannot be resharded onto {len(parts)} "
            "optimizer parts; resume with checkpoint.weights_only=true or the saved layout"
        )
    for i, part in enumerate(parts):
        # The tensors were loaded into this layout's structure (one entry per part).
        _load_optimizer_part(part, state[i], step, fmt)
    optimizer._synchronize_steps()


def sharded_state(trainable: Trainable, *, with_optimizer: bool, loading: bool,
                  fmt: str, prefix: str = "") -> dict[str, Any]:
    """The sharded state dict of the model chunks and, if asked, their optimizer in
    format `fmt` (`OPTIMIZER_FORMATS`).

    `prefix` starts every key of the model's tensors (and so of its optimizer state,
    which is keyed by them): a second trainable in the same checkpoint (a critic) needs
    one, as its parameters have the same names as the policy's. dp_reshardable keys
    hold no parameter names, so a part's optimizer state needs the prefix added."""
    chunks: list[torch.nn.Module] = list(trainable.model)
    state = sharded_model_state(chunks, prefix)
    if with_optimizer:
        _materialize_adam_state(trainable.optimizer)  # no-op once Adam has stepped
        # On CPU the state gather runs through the `optimizer_state_gather` shim.
        optimizer = trainable.optimizer.sharded_state_dict(
            dict(state), is_loading=loading, metadata=optimizer_metadata(fmt))
        if prefix and fmt == "dp_reshardable":
            add_prefix_for_sharding(optimizer, prefix)
        state["optimizer"] = optimizer
    return state


def apply_loaded(
    trainable: Trainable, loaded: dict[str, Any], with_optimizer: bool, step: int,
    fmt: str, prefix: str = "",
) -> None:
    """Put a `dist_checkpointing.load` result (of `sharded_state` with `prefix`) into the
    model (and optimizer)."""
    chunks: list[torch.nn.Module] = list(trainable.model)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks, strict=True):
        state = {name.removeprefix(prefix): t for name, t in loaded[key].items()}
        unwrap_model(chunk).load_state_dict(state, strict=True)
    if with_optimizer:
        _load_optimizer(trainable.optimizer, loaded["optimizer"], step, fmt)
    else:
        # Weights only: the optimizer keeps fp32 main copies of the parameters
        # (distributed optimizer); refresh them from the weights just loaded.
        trainable.optimizer.reload_model_params()
