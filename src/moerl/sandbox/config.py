"""Typed configuration of the sandbox: default limits, hard maxima, isolation mode."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# "strict": bubblewrap + cgroups + rlimits (the only mode fit for hostile code).
# "no-cgroups": bubblewrap + rlimits; it gives up the process-count limit (RLIMIT_NPROC
# is not enforced for the sandbox uid when the host runs as root), the resident-memory
# limit (only an address-space rlimit remains), peak-memory accounting, and teardown by
# cgroup (it relies on the pid namespace alone). It must be chosen explicitly.
Isolation = Literal["strict", "no-cgroups"]

WEAKER_MODE_NOTICE = (
    "isolation='no-cgroups' runs bubblewrap + rlimits only: no process-count limit "
    "(fork bombs are stopped only by the wall-clock limit), memory limited as address "
    "space rather than resident memory, no peak-memory accounting, and teardown by "
    "pid-namespace death instead of a freezer cgroup."
)


@dataclass(frozen=True)
class Limits:
    """Resource limits of one execution. Requests are clamped to `SandboxConfig.max_limits`."""

    wall_time_s: float = 10.0
    """Wall-clock limit; the whole process tree is killed when it passes."""
    cpu_time_s: float = 10.0
    """CPU-time limit per process (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Resident memory of the whole tree (cgroup); address space is capped at 2x + 512 MiB."""
    max_processes: int = 64
    """Processes and threads alive at once in the tree (pids cgroup)."""
    max_file_size_mb: int = 64
    """Largest file a program may write (RLIMIT_FSIZE)."""
    max_output_bytes: int = 1 << 20
    """Captured bytes per stream (stdout, stderr); more ends the run as output_limit."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"Limits.{f.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"Limits.{f.name} must be finite and > 0, got {value!r}")

    def clamped_to(self, maxima: Limits) -> Limits:
        """Each field is the smaller of this request and the maximum (a model may ask for
        `timeout=1e9`; it gets the configured maximum)."""
        return Limits(
            **{
                f.name: min(getattr(self, f.name), getattr(maxima, f.name))
                for f in dataclasses.fields(self)
            }
        )


def clamp_request(requested: dict[str, float], default: Limits, maxima: Limits) -> Limits:
    """Limits from an untrusted request: unknown keys are rejected, non-finite or
    non-positive values fall back to the maximum, and everything is clamped."""
    known = {f.name for f in dataclasses.fields(Limits)}
    unknown = set(requested) - known
    if unknown:
        raise ValueError(f"unknown limit(s) {sorted(unknown)}; known: {sorted(known)}")
    values: dict[str, Any] = {}
    for name in known:
        raw = requested.get(name, getattr(default, name))
        numeric = isinstance(raw, (int, float)) and not isinstance(raw, bool)
        try:
            number = float(raw) if numeric else 0.0
        except OverflowError:  # an int past any float (10**400): more than any maximum
            number = math.inf
        if not math.isfinite(number) or number <= 0:
            number = float(getattr(maxima, name))
        is_int = isinstance(getattr(default, name), int)
        values[name] = max(1, int(min(number, 1e15))) if is_int else number
    return Limits(**values).clamped_to(maxima)


@dataclass(frozen=True)
class SandboxConfig:
    """How programs are isolated and the limits they get."""

    isolation: Isolation = "strict"
    """'strict' refuses to run without bubblewrap and cgroups; see WEAKER_MODE_NOTICE."""
    default_limits: Limits = field(default_factory=Limits)
    max_limits: Limits = field(
        default_factory=lambda: Limits(
            wall_time_s=60.0,
            cpu_time_s=60.0,
            memory_mb=4096,
            max_processes=256,
            max_file_size_mb=256,
            max_output_bytes=8 << 20,
        )
    )
    """Hard ceilings; no request can raise a limit above these."""
    bwrap_path: str = "/usr/bin/bwrap"
    setpriv_path: str = "/usr/bin/setpriv"
    """Used when running as root, to start bwrap as `sandbox_uid` on the host too."""
    python_path: str = "/usr/bin/python3"
    """Interpreter used inside the sandbox: the system one, whose files live under /usr."""
    ro_binds: tuple[str, ...] = ("/usr",)
    """Host paths bound read-only; /bin, /lib, /lib64, /sbin become links into /usr."""
    etc_files: tuple[str, ...] = ("/etc/ld.so.cache", "/etc/alternatives")
    """The few /etc entries the runtimes read; /etc as a whole is never bound."""
    work_root: Path | None = None
    """Where per-run work dirs are created; None means the system temp dir."""
    cgroup_name: str = "moerl-sandbox"
    """Sub-tree created under this process's own cgroup for each controller."""
    sandbox_uid: int = 65534
    sandbox_gid: int = 65534
    warm_slots: int = 0
    """Executions `Sandbox.run_fresh` keeps launched ahead of time per launch signature
    (bwrap set up, each slot used once; see warm.py); 0 launches every run on demand."""

    def __post_init__(self) -> None:
        if self.isolation not in ("strict", "no-cgroups"):
            raise ValueError(
                f"SandboxConfig.isolation must be 'strict' or 'no-cgroups', got {self.isolation!r}"
            )
        if self.warm_slots < 0:
            raise ValueError(f"SandboxConfig.warm_slots must be >= 0, got {self.warm_slots}")
        if self.sandbox_uid == 0 or self.sandbox_gid == 0:
            raise ValueError("SandboxConfig.sandbox_uid/gid must not be 0 (root)")
        object.__setattr__(self, "default_limits", self.default_limits.clamped_to(self.max_limits))
