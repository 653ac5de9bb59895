"""Fixtures shared by unit tests: a real sandbox with small limits (sandbox and reward
tests) and one process's torch.distributed + Megatron groups (model tests)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from moerl.sandbox import Limits, Sandbox, SandboxConfig

if TYPE_CHECKING:
    from moerl.parallel.groups import ParallelGroups


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    # Small maxima keep hostile-program tests short; the defaults are clamped to them.
    return Sandbox(
        SandboxConfig(
            default_limits=Limits(wall_time_s=5, cpu_time_s=5, memory_mb=256, max_processes=32),
            max_limits=Limits(
                wall_time_s=5,
                cpu_time_s=5,
                memory_mb=512,
                max_processes=64,
                max_file_size_mb=16,
                max_output_bytes=1 << 20,
            ),
        )
    )


@pytest.fixture(scope="module")
def single_process() -> Iterator[ParallelGroups]:
    """torch.distributed (gloo) and Megatron's groups for one process, per test module."""
    from megatron.core.transformer.moe import moe_logging

    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout

    groups = init_parallel(ParallelLayout(), seed=0)
    yield groups
    destroy_parallel()
    # The MoE aux-loss tracker is process-global and sized by the last model's depth.
    moe_logging.destroy_moe_metrics_tracker()
