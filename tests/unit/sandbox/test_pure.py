"""Pure parts of the sandbox: limit clamping, cgroup layout detection, the BPF program."""

import math
import struct

import pytest

from moerl.sandbox.cgroups import CgroupUnavailable, plan_layout
from moerl.sandbox.config import Limits, SandboxConfig, clamp_request
from moerl.sandbox.seccomp import SeccompUnsupported, build_filter, denied_syscalls

MAXIMA = Limits(wall_time_s=30, cpu_time_s=30, memory_mb=1024, max_processes=64)


def test_model_requested_limits_are_clamped_to_the_maxima() -> None:
    got = clamp_request({"wall_time_s": 1e9, "memory_mb": 1 << 40}, Limits(), MAXIMA)
    assert got.wall_time_s == 30 and got.memory_mb == 1024
    assert got.cpu_time_s == Limits().cpu_time_s  # untouched fields keep the default


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1, 0, "10", True, None, 10**400])
def test_nonsense_limit_values_fall_back_to_the_maximum_never_unlimited(bad: object) -> None:
    got = clamp_request({"wall_time_s": bad}, Limits(), MAXIMA)  # type: ignore[dict-item]
    assert got.wall_time_s == MAXIMA.wall_time_s


def test_unknown_limit_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown limit"):
        clamp_request({"wall_time": 3}, Limits(), MAXIMA)


def test_limits_reject_invalid_values_and_config_clamps_defaults() -> None:
    with pytest.raises(ValueError):
        Limits(wall_time_s=math.inf)
    cfg = SandboxConfig(default_limits=Limits(wall_time_s=100), max_limits=MAXIMA)
    assert cfg.default_limits.wall_time_s == 30
    with pytest.raises(ValueError, match="isolation"):
        SandboxConfig(isolation="none")  # type: ignore[arg-type]


V1_MOUNTS = """\
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup /sys/fs/cgroup/freezer cgroup rw,relatime,freezer 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
V1_SELF = "6:freezer:/\n5:pids:/a\n4:memory:/box/1\n2:cpu,cpuacct:/\n0::/\n"


def test_v1_layout_nests_under_own_cgroup_per_controller() -> None:
    layout = plan_layout(V1_MOUNTS, V1_SELF, "sbx")
    assert layout.version == 1
    assert str(layout.bases["memory"]) == "/sys/fs/cgroup/memory/box/1/sbx"
    assert str(layout.bases["pids"]) == "/sys/fs/cgroup/pids/a/sbx"
    assert str(layout.bases["cpuacct"]) == "/sys/fs/cgroup/cpu,cpuacct/sbx"


def test_v2_layout_and_missing_cgroups() -> None:
    layout = plan_layout("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n", "0::/user/app\n", "sbx")
    assert layout.version == 2
    assert str(layout.bases["unified"]) == "/sys/fs/cgroup/user/app/sbx"
    with pytest.raises(CgroupUnavailable, match="no usable cgroups"):
        plan_layout("proc /proc proc rw 0 0\n", "0::/\n", "sbx")


def test_seccomp_program_denies_ptrace_and_checks_the_architecture() -> None:
    prog = build_filter("x86_64")
    insns = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    assert insns[0] == (0x20, 0, 0, 4)  # load arch first
    assert insns[1][3] == 0xC000003E
    jeqs = {k: i for i, (code, _, _, k) in enumerate(insns) if code == 0x15 and i > 1}
    errno_ret = len(insns) - 2
    for name in ("ptrace", "process_vm_readv"):
        nr = denied_syscalls("x86_64")[name]
        at = jeqs[nr]
        assert at + 1 + insns[at][1] == errno_ret  # jump target is the EPERM return
    assert insns[-3] == (0x06, 0, 0, 0x7FFF0000)  # default allow
    with pytest.raises(SeccompUnsupported):
        build_filter("sparc")
