"""Every CPU shim megatron-core 0.19 needs, in one place.

Megatron-Core assumes CUDA in a handful of places. Each shim below is a small
function that patches exactly one such place, with the reason in its docstring;
`apply_cpu_shims()` applies them all, only when no GPU is present, and is
idempotent. `shim_disabled(name)` lifts one shim for a test that shows it is
needed. A catch-all `TorchFunctionMode` also works but costs 35-40% of the
forward time, so each shim stays narrow.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Patch:
    owner: Any
    attr: str
    original: Any


_APPLIED: dict[str, list[_Patch]] = {}
_current: list[str] = []  # the shim being applied, so `_set` knows whose patch it is


def _set(owner: Any, attr: str, value: Any) -> None:
    # Keep a class's own descriptor (classmethod, staticmethod) so undo restores it.
    if isinstance(owner, type) and attr in owner.__dict__:
        original = owner.__dict__[attr]
    else:
        original = getattr(owner, attr)
    _APPLIED[_current[-1]].append(_Patch(owner, attr, original))
    setattr(owner, attr, value)


def shim_current_device() -> None:
    """`torch.cuda.current_device()` is used as a device by the rotary embedding
    (MLA builds it without `use_cpu_initialization`) and the router; on CPU it
    raises "Found no NVIDIA driver". Answer "cpu", which every caller only passes
    on as `device=`."""
    _set(torch.cuda, "current_device", lambda: "cpu")


class _CpuStream:
    """A CUDA stream / event stand-in: CPU work is already in program order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuStream:
        return self

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CPU_STREAM = _CpuStream()


def shim_checkpoint_rng() -> None:
    """Activation recompute (`recompute.granularity`) saves and restores the CUDA RNG
    state around each checkpointed block so that dropout draws the same masks again;
    on CPU `torch.cuda.get_rng_state` raises "Found no NVIDIA driver". There is no CUDA
    generator to keep: an empty state, and restoring it does nothing (the CPU state
    and the tracker's states are saved and restored beside it, unchanged)."""
    from megatron.core.tensor_parallel import random as tp_random

    _set(tp_random, "_get_cuda_rng_state",
         lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8))
    _set(tp_random, "_set_cuda_rng_state", lambda *args, **kwargs: None)


class _NoWork:
    """A finished collective: what a coalescing block with nothing to send returns."""

    def wait(self) -> None:
        pass


def _one_rank(group: Any) -> bool:
    return group is not None and torch.distributed.get_world_size(group) == 1


def skip_one_rank(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original(output, source, group=...)`, skipped when the group has one rank and
    the output is the source's memory (nothing to gather or reduce)."""

    @functools.wraps(original)
    def collective(output: torch.Tensor, source: torch.Tensor, *args: Any,
                   group: Any = None, **kwargs: Any) -> Any:
        if (_one_rank(group) and output.data_ptr() == source.data_ptr()
                and output.numel() == source.numel()):
            return _NoWork() if kwargs.get("async_op") else None
        return original(output, source, *args, group=group, **kwargs)

    return collective


def coalesce_one_rank(coalescing: Callable[..., Any]) -> Callable[..., Any]:
    """`coalescing(group, ...)` as a context manager that opens nothing for a group
    of one rank."""

    @contextmanager
    def coalesce(group: Any = None, *args: Any, **kwargs: Any) -> Iterator[Any]:
        if _one_rank(group):
            yield _NoWork()
            return
        with coalescing(group, *args, **kwargs) as manager:
            yield manager

    return coalesce


def shim_one_rank_buffer_sync() -> None:
    """DDP's grad reduce-scatter and the distributed optimizer's param all-gather run
    through a coalesced collective even when the data-parallel group holds one rank,
    where the one shard is the whole buffer (input and output are the same memory).
    On gloo that still copies every bucket: ~5 ms of the tiny model's 160 ms SFT step.
    Such a collective is skipped, and the coalescing block around it opens no gloo
    coalescing; groups of more ranks are untouched."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    _set(buffers, "dist_all_gather_func", skip_one_rank(buffers.dist_all_gather_func))
    _set(buffers, "dist_reduce_scatter_func", skip_one_rank(buffers.dist_reduce_scatter_func))
    _set(buffers, "_coalescing_manager", coalesce_one_rank(buffers._coalescing_manager))


def shim_streams() -> None:
    """The alltoall dispatcher (device-to-host copies of split sizes) and shared
    experts create `torch.cuda.Stream()`/`Event()` and enter `torch.cuda.stream(s)`
    unconditionally; without a driver these raise. On CPU there is one ordered
    stream, so every stream and event is a no-op stand-in."""
    _set(torch.cuda, "Stream", _CpuStream)
    _set(torch.cuda, "Event", _CpuStream)
    _set(torch.cuda, "current_stream", lambda device=None: _CPU_STREAM)
    _set(torch.cuda, "stream", lambda stream=None: nullcontext())


def shim_split_sizes() -> None:
    """The alltoall dispatcher turns its all-to-all split sizes into numpy through
    `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which only converts CUDA
    tensors. On CPU they stay tensors, and gloo's `all_to_all_single` at EP > 1
    rejects tensor split sizes. Convert CPU tensors too."""
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _set(token_dispatcher, "maybe_move_tensor_to_cpu", move)


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    # [sq, sq] bool, True above the diagonal (positions a query may not see)
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def shim_causal_mask() -> None:
    """`get_default_causal_mask` (used by the local attention's softmax when no
    mask is passed) hard-codes `device="cuda"`. It is the only CUDA assumption on
    the forward path; build the same mask on CPU."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    _set(utils, "get_default_causal_mask", _cpu_causal_mask)
    _set(fused_softmax, "get_default_causal_mask", _cpu_causal_mask)


_FACTORIES = ("zeros", "ones", "empty", "empty_like", "full", "tensor", "arange")


class _CpuTorch(types.ModuleType):
    """`torch` as seen from one Megatron module: tensor factories asked for
    `device="cuda"` build on CPU instead; everything else is torch itself."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name not in _FACTORIES:
            return value

        def factory(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)

        return factory


_TRAINING_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
)


def shim_cuda_device_strings() -> None:
    """The pipeline schedules (token counter), optimizers (found-inf flags, grad-norm
    buffers) and grad buffers create small tensors with a hard-coded
    `device="cuda"`. Give exactly those modules a `torch` whose factories build on
    CPU; the forward path (model code) is untouched, so it costs nothing there."""
    import importlib

    for module_name in _TRAINING_MODULES:
        _set(importlib.import_module(module_name), "torch", _CpuTorch())
    # Gradient clipping's fallback l2-norm kernel (megatron.core.utils, which is on
    # the forward path, so it is replaced rather than given the proxy).
    from megatron.core.optimizer import clip_grads

    _set(clip_grads, "l2_norm_impl", _cpu_l2_norm)


def _cpu_l2_norm(
    chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], *args: Any
) -> tuple[torch.Tensor, None]:
    # Norm of the norms of every tensor: [1] float32, as the fused kernel returns.
    norms = [torch.norm(t.float()) for tensors in tensor_lists for t in tensors]
    return torch.norm(torch.stack(norms)).reshape(1), None


def _with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run with `Tensor.type()` naming CPU tensors as their CUDA twins."""
    names = {
        "torch.FloatTensor": "torch.cuda.FloatTensor",
        "torch.HalfTensor": "torch.cuda.HalfTensor",
        "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    }

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        original = torch.Tensor.type

        def type_(self: torch.Tensor, *targs: Any, **tkwargs: Any) -> Any:
            result = original(self, *targs, **tkwargs)
            return names.get(result, result) if not targs and not tkwargs else result

        torch.Tensor.type = type_  # type: ignore[method-assign,assignment]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = original  # type: ignore[method-assign]

    return wrapped


def shim_cuda_type_checks() -> None:
    """The distributed optimizer (building its fp32 main params), the fp16/bf16
    optimizer and gradient clipping assert `param.type() == 'torch.cuda.FloatTensor'`
    and reject CPU tensors. Only these three calls (set-up, and clipping once a
    step) see CPU float tensors named as CUDA ones; `Tensor.type` is restored after."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    dist_opt = distrib_optimizer.DistributedOptimizer
    build = dist_opt.__dict__["_build_model_and_main_param_groups"].__func__
    _set(dist_opt, "_build_model_and_main_param_groups",
         classmethod(_with_cuda_type_names(build)))
    f16_init = optimizer.Float16OptimizerWithFloat16Params.__init__
    _set(optimizer.Float16OptimizerWithFloat16Params, "__init__", _with_cuda_type_names(f16_init))
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    _set(clip_grads, "clip_grad_by_total_norm_fp32", clip)
    _set(optimizer, "clip_grad_by_total_norm_fp32", clip)


def _with_tensor_cuda_as_noop(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run with `Tensor.cuda()` returning the tensor itself."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original  # type: ignore[method-assign]

    return wrapped


def shim_embedding_sync() -> None:
    """With pipeline stages (or MTP on the last stage), the language model copies
    the word embeddings to the last stage by `weight.data.cuda()` and an
    all-reduce, at construction. Run that set-up with `.cuda()` as a no-op."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer
    _set(LanguageModule, "setup_embeddings_and_output_layer", _with_tensor_cuda_as_noop(setup))


def shim_optimizer_state_gather() -> None:
    """The distributed optimizer gathers its state over data-parallel ranks for a
    checkpoint (`get_parameter_state_dp_zero`, reached from `sharded_state_dict`)
    with `send_tensor.cuda()` before the gather; gloo gathers the CPU tensor as it
    is, so run that with `.cuda()` as a no-op."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    gather = DistributedOptimizer.get_parameter_state_dp_zero
    _set(DistributedOptimizer, "get_parameter_state_dp_zero", _with_tensor_cuda_as_noop(gather))


def shim_parallel_load_exchange() -> None:
    """A fully parallel checkpoint load reads each replicated tensor on one rank of
    the data-parallel group and broadcasts it to the others
    (`exchange_utils.exchange_by_distribution`), staging every tensor on the GPU first:
    `.cuda()` of the loaded ones, `ShardedTensor.init_data("cuda")` and
    `torch.empty_like(..., device="cuda")` for the receiving buffers. gloo broadcasts CPU
    tensors as they are: run the exchange with those building on CPU."""
    from megatron.core.dist_checkpointing import exchange_utils
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    _set(exchange_utils, "torch", _CpuTorch())
    exchange = _with_tensor_cuda_as_noop(exchange_utils.exchange_by_distribution)
    init_data = ShardedTensor.init_data

    @functools.wraps(exchange)
    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        def cpu_init(self: ShardedTensor, device: Any, *a: Any, **k: Any) -> None:
            init_data(self, "cpu" if str(device).startswith("cuda") else device, *a, **k)

        ShardedTensor.init_data = cpu_init
        try:
            return exchange(*args, **kwargs)
        finally:
            ShardedTensor.init_data = init_data

    _set(exchange_utils, "exchange_by_distribution", on_cpu)
    _set(fully_parallel, "exchange_by_distribution", on_cpu)


def shim_synchronize() -> None:
    """Batched pipeline p2p calls `torch.cuda.synchronize()` after its sends and
    receives (a guard for NCCL); gloo's waits already completed them, so on CPU it
    is a no-op."""
    _set(torch.cuda, "synchronize", lambda device=None: None)


def shim_norm_sequence_parallel() -> None:
    """The local spec's norm (`WrappedTorchNorm`, used without Apex or TE) asserts
    `not config.sequence_parallel`, though a norm is per token and works on a
    sequence shard as well. Build it without the flag, then tag its parameters
    `.sequence_parallel = True` as Megatron's own norms do, so that
    `finalize_model_grads` all-reduces their partial gradients over the TP group."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def new(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    _set(WrappedTorchNorm, "__new__", new)


def shim_cp_rotary_split() -> None:
    """Under context parallelism RoPE keeps this rank's positions with
    `get_pos_emb_on_this_cp_rank`, which builds its index with `pin_memory=True`
    and `.cuda()`. Use the same load-balanced split built on CPU."""
    from megatron.core.models.common.embeddings import (
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )

    from moerl.parallel.context import split_for_cp_rank

    def split(emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
        return split_for_cp_rank(emb, cp_group.rank(), cp_group.size(), dim=seq_dim)

    for module in (rotary_pos_embedding, yarn_rotary_pos_embedding):
        _set(module, "get_pos_emb_on_this_cp_rank", split)


def shim_uneven_gather() -> None:
    """With expert tensor parallelism (etp > 1) the alltoall dispatcher all-gathers the
    tokens routed to this rank's experts over the expert-TP group, each rank holding its
    own number (`gather_from_sequence_parallel_region` with `output_split_sizes`).
    Megatron passes uneven tensors to `torch.distributed.all_gather`, which NCCL accepts
    and gloo rejects ("invalid tensor size"). Pad every rank's part to the longest,
    gather, and cut the padding off. (The reverse, an uneven list reduce-scatter, works
    on gloo.)"""
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_first_dim

    def gather(input_: torch.Tensor, group: Any, output_split_sizes: Any = None,
               use_global_buffer: bool = False) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])

    _set(mappings, "_gather_along_first_dim", gather)


SHIMS: dict[str, Callable[[], None]] = {
    "cp_rotary_split": shim_cp_rotary_split,
    "embedding_sync": shim_embedding_sync,
    "optimizer_state_gather": shim_optimizer_state_gather,
    "parallel_load_exchange": shim_parallel_load_exchange,
    "norm_sequence_parallel": shim_norm_sequence_parallel,
    "cuda_device_strings": shim_cuda_device_strings,
    "cuda_type_checks": shim_cuda_type_checks,
    "synchronize": shim_synchronize,
    "causal_mask": shim_causal_mask,
    "current_device": shim_current_device,
    "streams": shim_streams,
    "checkpoint_rng": shim_checkpoint_rng,
    "one_rank_buffer_sync": shim_one_rank_buffer_sync,
    "split_sizes": shim_split_sizes,
    "uneven_gather": shim_uneven_gather,
}


def _apply(name: str) -> None:
    if name in _APPLIED:
        return
    _APPLIED[name] = []
    _current.append(name)
    try:
        SHIMS[name]()
    finally:
        _current.pop()


def _undo(name: str) -> None:
    for patch in reversed(_APPLIED.pop(name, [])):
        setattr(patch.owner, patch.attr, patch.original)


def apply_cpu_shims(force: bool = False) -> None:
    """Apply every shim once, when no GPU is present (or `force`, for tests)."""
    if torch.cuda.is_available() and not force:
        return
    for name in SHIMS:
        _apply(name)


def applied() -> list[str]:
    return list(_APPLIED)


@contextmanager
def shim_disabled(name: str) -> Iterator[None]:
    """Lift shim `name` inside the block (it is put back afterwards if it was on)."""
    was_on = name in _APPLIED
    _undo(name)
    try:
        yield
    finally:
        if was_on:
            _apply(name)
