"""A real sandbox with small limits, shared by the sandbox and reward tests."""

import shutil

import pytest

from moerl.rl.sandbox import Limits, Sandbox, SandboxConfig


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
