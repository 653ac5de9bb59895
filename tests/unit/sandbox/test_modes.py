"""Refusal without the safety layers, and the explicitly chosen weaker mode."""

import pytest

from moerl.sandbox import (
    ExecutionStatus,
    Limits,
    Sandbox,
    SandboxConfig,
    SandboxUnavailable,
    runner,
)
from moerl.sandbox.cgroups import CgroupUnavailable

pytestmark = pytest.mark.sandbox


def test_refuses_without_bubblewrap() -> None:
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap not found.*never run without it"):
        Sandbox(SandboxConfig(bwrap_path="/nonexistent/bwrap"))


def test_refuses_without_cgroups_unless_the_weaker_mode_is_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_cgroups(name: str) -> None:
        raise CgroupUnavailable("no usable cgroups (simulated)")

    monkeypatch.setattr(runner, "detect", no_cgroups)
    with pytest.raises(SandboxUnavailable, match=r"isolation='no-cgroups'.*no process-count limit"):
        Sandbox(SandboxConfig())
    weaker = Sandbox(SandboxConfig(isolation="no-cgroups"))  # never calls detect
    assert weaker.layout is None


def test_weaker_mode_still_isolates_and_enforces_wall_time() -> None:
    sandbox = Sandbox(SandboxConfig(isolation="no-cgroups"))
    with sandbox.workspace() as ws:
        ok = sandbox.run(["/bin/sh", "-c", "id -u; cat /etc/shadow"], ws)
        assert ok.stdout == b"65534\n" and ok.status is ExecutionStatus.RUNTIME_ERROR
        looped = sandbox.run(
            ["/bin/sh", "-c", "setsid sleep 100 & sleep 100"], ws, limits=Limits(wall_time_s=1)
        )
    assert looped.status is ExecutionStatus.TIMEOUT and looped.wall_time_s < 3
