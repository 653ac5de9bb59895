"""One rank of a job that does not exist: a fake process group and tensors without memory.

    with fake_rank(layout, rank=17) as groups:
        policy = build(groups)           # the run's own builders, as on that rank
        count(policy)                    # shapes and dtypes are real; no byte is held

torch's fake backend (`parallel.groups.init_fake_parallel`) gives the rank its place
in every Megatron group of the real job; FakeTensorMode makes every tensor created
inside, parameters and Megatron's buffers included, a tensor with shape, dtype and
storage identity but no data. One collective needs help: `all_gather_object` must
hand back objects to unpickle, and the fake backend returns none, so every rank is
given this rank's object (Megatron gathers its parameter-group keys with it, which
agree on every rank of a real job).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from megatron.core.transformer.moe import moe_logging
from torch._subclasses.fake_tensor import FakeTensorMode

from moerl.parallel.groups import ParallelGroups, destroy_parallel, init_fake_parallel
from moerl.parallel.layout import ParallelLayout


@contextmanager
def _objects_from_this_rank() -> Iterator[None]:
    real = dist.all_gather_object

    def gather(object_list: list[Any], obj: Any, group: Any = None) -> None:
        object_list[:] = [obj] * len(object_list)

    dist.all_gather_object = gather
    try:
        yield
    finally:
        dist.all_gather_object = real


@contextmanager
def fake_rank(layout: ParallelLayout, rank: int, backend: str = "nccl"
              ) -> Iterator[ParallelGroups]:
    """Global `rank` of a `layout.world_size`-rank job on `backend`; everything built
    inside holds no memory. The process groups are gone when the block ends."""
    groups = init_fake_parallel(layout, rank, backend)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), _objects_from_this_rank():
            yield groups
    finally:
        destroy_parallel()
        # Megatron keeps MoE layers' metrics per process; the next rank may be deeper.
        moe_logging.destroy_moe_metrics_tracker()
