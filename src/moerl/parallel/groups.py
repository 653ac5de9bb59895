"""torch.distributed and Megatron-Core process groups for a `ParallelLayout`.

Under torchrun the usual environment variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) describe the job; without them this is a single process and a
one-rank group is made on a private TCP store on 127.0.0.1. The backend is nccl
when CUDA is present and gloo otherwise (where the CPU shims are applied first).

`init_fake_parallel` makes this process one rank of a job that does not exist, on
torch's fake backend (collectives return at once and move nothing, as Megatron-LM's
`--fake-process-group`): the groups, ranks and sizes of the real job, for building
what that rank would hold (`moerl rehearse`).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from moerl.parallel.cpu_shims import apply_cpu_shims
from moerl.parallel.layout import LayoutError, ParallelLayout
from moerl.parent_death import die_with_parent
from moerl.ports import free_port


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the layout, and the groups callers pass around."""

    layout: ParallelLayout
    backend: str
    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_rank: int
    dp_group: dist.ProcessGroup  # data parallel: ranks that hold different samples
    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup  # context parallel: ranks that hold parts of the same rows
    pp_group: dist.ProcessGroup
    device: torch.device

    @property
    def is_pp_last(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """The rank that prints: the last pipeline stage (it holds the loss), first of
        dp/tp/cp."""
        return (self.is_pp_last and self.dp_rank == 0 and self.tp_rank == 0
                and self.cp_group.rank() == 0)


def _init_process_group(backend: str) -> None:
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # A rank of torchrun: it must not outlive its agent (a SIGKILLed torchrun
            # runs no teardown, and each rank is in a session of its own).
            die_with_parent(os.getppid(), signal.SIGKILL)
        dist.init_process_group(backend=backend)
        return
    # One process without torchrun: a private store, so tests can run in parallel.
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)


def init_parallel(
    layout: ParallelLayout, backend: str | None = None, seed: int = 0
) -> ParallelGroups:
    """Start torch.distributed and Megatron's model-parallel groups for `layout`.

    The layout is checked against the world size first (a wrong dp fails here
    with the field named, not deep inside Megatron).
    """
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if not cuda:
        apply_cpu_shims()
    elif "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    _init_process_group(backend)
    world = dist.get_world_size()
    if world != layout.world_size:
        raise LayoutError(
            f"parallel: tp*pp*cp*dp = {layout.world_size} but {world} ranks were started; "
            f"set parallel.dp={max(world // (layout.tp * layout.pp * layout.cp), 1)} "
            f"or start {layout.world_size} ranks"
        )
    _megatron_groups(layout, gloo=True)
    _seed(seed, cuda)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return _this_rank(layout, backend, device)


def init_fake_parallel(layout: ParallelLayout, rank: int, backend: str = "nccl") -> ParallelGroups:
    """This process as global `rank` of a job of `layout.world_size` ranks, on torch's fake
    process group; `backend` is the one the job would run on (builders read it). Megatron's
    gloo groups are not made (the fake backend cannot), and the CPU shims are applied."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError("init_fake_parallel: torch.distributed is already initialised")
    apply_cpu_shims()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    _megatron_groups(layout, gloo=False)
    _seed(0, cuda=False)
    return _this_rank(layout, backend, torch.device("cpu"))


def _megatron_groups(layout: ParallelLayout, gloo: bool) -> None:
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        create_gloo_process_groups=gloo,
    )


def gloo_groups_built() -> bool:
    """Whether Megatron's gloo groups exist (not on a fake process group)."""
    try:
        ps.get_data_parallel_group_gloo(with_context_parallel=True, partial_data_parallel=True)
    except AssertionError:
        return False
    return True


def _this_rank(layout: ParallelLayout, backend: str, device: torch.device) -> ParallelGroups:
    return ParallelGroups(
        layout=layout,
        backend=backend,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_group=ps.get_data_parallel_group(),
        tp_group=ps.get_tensor_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        device=device,
    )


def _seed(seed: int, cuda: bool) -> None:
    """Same seed on every rank: CPU init draws full matrices and slices them, so
    weights are identical whatever the layout."""
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    torch.manual_seed(seed)
    # No CUDA RNG to fork per tp rank; the inference tracker is a plain CPU one.
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def destroy_parallel() -> None:
    """Tear down Megatron's groups and torch.distributed (safe to call twice)."""
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
