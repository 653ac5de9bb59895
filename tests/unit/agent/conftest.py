import shutil

import pytest

from moerl.sandbox import Limits, Sandbox, SandboxConfig


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    return Sandbox(SandboxConfig(max_limits=Limits(wall_time_s=5, cpu_time_s=5, memory_mb=512)))
