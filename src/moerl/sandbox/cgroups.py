"""Per-execution cgroups: detection of v1/v2 at run time, limits, accounting, teardown.

Each execution gets its own group (one per controller on v1) under this process's own
cgroup, named `<owner pid>-<run id>`, so that leftovers of a crashed server can be found
and removed by the next one (`sweep_stale`). Leftover processes are looked for by
cgroup, not by uid: under bubblewrap the sandbox uid can map back to the caller's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

_V1_REQUIRED = ("memory", "pids", "freezer")
_V1_OPTIONAL = ("cpuacct",)
_V2_REQUIRED = ("memory", "pids")


class CgroupUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class CgroupLayout:
    version: int
    bases: dict[str, Path]
    """v1: controller -> our sub-tree; v2: {"unified": our sub-tree}."""


def _mounts(mounts_text: str) -> list[tuple[str, str, set[str]]]:
    """(fstype, mount point, options) of every cgroup mount."""
    found = []
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
            found.append((parts[2], parts[1], set(parts[3].split(","))))
    return found


def _own_paths(proc_cgroup_text: str) -> dict[str, str]:
    """controller -> this process's cgroup path ("" names the v2 hierarchy)."""
    paths: dict[str, str] = {}
    for line in proc_cgroup_text.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def plan_layout(mounts_text: str, proc_cgroup_text: str, name: str) -> CgroupLayout:
    """Pure part of detection: v1 when memory, pids and freezer are mounted as v1
    hierarchies (hybrid hosts included), otherwise v2 when the unified hierarchy is
    mounted at /sys/fs/cgroup or elsewhere."""
    mounts = _mounts(mounts_text)
    own = _own_paths(proc_cgroup_text)
    v1 = {c: mp for fstype, mp, opts in mounts if fstype == "cgroup" for c in opts}
    if all(c in v1 and c in own for c in _V1_REQUIRED):
        wanted = _V1_REQUIRED + tuple(c for c in _V1_OPTIONAL if c in v1 and c in own)
        bases = {c: Path(v1[c]) / own[c].lstrip("/") / name for c in wanted}
        return CgroupLayout(version=1, bases=bases)
    v2 = [mp for fstype, mp, _ in mounts if fstype == "cgroup2"]
    if v2 and "" in own:
        return CgroupLayout(version=2, bases={"unified": Path(v2[0]) / own[""].lstrip("/") / name})
    missing = [c for c in _V1_REQUIRED if c not in v1]
    raise CgroupUnavailable(
        f"no usable cgroups: v1 controllers missing {missing} and no cgroup2 mount"
    )


def detect(name: str) -> CgroupLayout:
    """Find the cgroup hierarchy and make our sub-tree, or explain why it cannot be used."""
    try:
        layout = plan_layout(
            Path("/proc/self/mounts").read_text(), Path("/proc/self/cgroup").read_text(), name
        )
        for base in layout.bases.values():
            base.mkdir(exist_ok=True)
        if layout.version == 2:
            _enable_v2_controllers(layout.bases["unified"])
    except OSError as exc:
        raise CgroupUnavailable(
            f"cannot create the sandbox cgroup sub-tree ({exc}); run as root or in a "
            "delegated cgroup (e.g. `systemd-run --scope -p Delegate=yes`)"
        ) from exc
    return layout


def _enable_v2_controllers(base: Path) -> None:
    # v2 forbids processes in inner groups that delegate controllers: the parent (our own
    # cgroup) must have no other processes, which is the case in a delegated scope.
    enable = " ".join(f"+{c}" for c in _V2_REQUIRED)
    for group in (base.parent, base):
        available = (group / "cgroup.controllers").read_text().split()
        if not all(c in available for c in _V2_REQUIRED):
            raise CgroupUnavailable(
                f"cgroup v2 at {group} does not offer {list(_V2_REQUIRED)} (has {available})"
            )
        (group / "cgroup.subtree_control").write_text(enable)


def _read_small(path: Path, fd: int | None = None) -> str:
    """A cgroup file of a few lines ("" when unreadable): one pread of `fd` when it is
    held open, else one open and one read."""
    if fd is not None:
        try:
            return os.pread(fd, 4096, 0).decode("ascii", "replace")
        except OSError:
            return ""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return os.read(fd, 4096).decode("ascii", "replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _first_int(text: str, default: int = 0) -> int:
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return default


def _keyed(text: str, key: str) -> int:
    """Value of `key N` in a flat-keyed file such as memory.events."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            try:
                return int(parts[1])
            except ValueError:
                return 0
    return 0


@dataclass(frozen=True)
class CgroupStats:
    cpu_time_s: float | None
    peak_memory_bytes: int | None
    oom_killed: bool
    pids_limit_hit: bool


class Cgroup:
    """The group(s) of one execution."""

    def __init__(self, layout: CgroupLayout, run_name: str) -> None:
        self.layout = layout
        self.dirs = {c: base / run_name for c, base in layout.bases.items()}
        self._held: dict[Path, int] = {}

    def create(self, memory_bytes: int, max_pids: int) -> None:
        for d in self.dirs.values():
            d.mkdir()
        if self.layout.version == 1:
            mem = self.dirs["memory"]
            (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
            # Without the memsw limit a program could spill past the limit into swap.
            with contextlib.suppress(OSError):
                (mem / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
            (self.dirs["pids"] / "pids.max").write_text(str(max_pids))
        else:
            d = self.dirs["unified"]
            (d / "memory.max").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(max_pids))

    @property
    def accounts_cpu(self) -> bool:
        """The group's counters hold the tree's CPU time (cpuacct on v1; always on v2)."""
        return self.layout.version == 2 or "cpuacct" in self.dirs

    def procs_files(self) -> list[Path]:
        """The files a new process writes its pid into to join every group."""
        return [d / "cgroup.procs" for d in self.dirs.values()]

    def hold_counters(self) -> None:
        """Open the counters read at the end of every execution (`stats`, `tasks`) now,
        so that reading them then is one pread each. Not cgroup.procs: on v1 an open
        file keeps the pid list of its first read. `remove` closes them."""
        for path in [*self._counter_files(), self._pids_dir() / "pids.current"]:
            with contextlib.suppress(OSError):
                self._held[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def tasks(self) -> int | None:
        """Tasks charged to the group: alive, or dead but not reaped yet; None when the
        counter cannot be read."""
        count = _first_int(self._read(self._pids_dir() / "pids.current"), -1)
        return count if count >= 0 else None

    def _pids_dir(self) -> Path:
        return self.dirs["pids"] if self.layout.version == 1 else self.dirs["unified"]

    def _counter_files(self) -> list[Path]:
        if self.layout.version == 1:
            mem, pids = self.dirs["memory"], self.dirs["pids"]
            files = [mem / "memory.max_usage_in_bytes", mem / "memory.oom_control",
                     pids / "pids.events"]  # fmt: skip
            cpu = self.dirs.get("cpuacct")
            return [*files, cpu / "cpuacct.usage"] if cpu else files
        d = self.dirs["unified"]
        return [d / "memory.peak", d / "cpu.stat", d / "memory.events", d / "pids.events"]

    def _read(self, path: Path) -> str:
        return _read_small(path, self._held.get(path))

    def stats(self) -> CgroupStats:
        read = self._read
        if self.layout.version == 1:
            mem, pids = self.dirs["memory"], self.dirs["pids"]
            cpu = self.dirs.get("cpuacct")
            return CgroupStats(
                cpu_time_s=_first_int(read(cpu / "cpuacct.usage")) / 1e9 if cpu else None,
                peak_memory_bytes=_first_int(read(mem / "memory.max_usage_in_bytes")),
                oom_killed=_keyed(read(mem / "memory.oom_control"), "oom_kill") > 0,
                pids_limit_hit=_keyed(read(pids / "pids.events"), "max") > 0,
            )
        d = self.dirs["unified"]
        peak = _first_int(read(d / "memory.peak"), -1)
        return CgroupStats(
            cpu_time_s=_keyed(read(d / "cpu.stat"), "usage_usec") / 1e6,
            peak_memory_bytes=peak if peak >= 0 else None,
            oom_killed=_keyed(read(d / "memory.events"), "oom_kill") > 0,
            pids_limit_hit=_keyed(read(d / "pids.events"), "max") > 0,
        )

    def pids(self) -> set[int]:
        found: set[int] = set()
        for procs in self.procs_files():
            with contextlib.suppress(OSError):
                found.update(int(p) for p in procs.read_text().split())
        return found

    def members(self) -> set[int]:
        """The pids of one group: every process joins all of them before bwrap starts and
        cannot move out (no cgroupfs inside), so one file says who is left."""
        return {int(p) for p in _read_small(self.procs_files()[0]).split()}

    def wait_empty(self, timeout_s: float) -> bool:
        """Poll until no process is left (True), or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.members():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def kill_all(self, timeout_s: float = 5.0) -> bool:
        """Kill every process in the group, including setsid'd daemons; True when empty."""
        deadline = time.monotonic() + timeout_s
        while self.pids():
            if time.monotonic() > deadline:
                return False
            if self.layout.version == 2:
                (self.dirs["unified"] / "cgroup.kill").write_text("1")
            else:
                self._freeze_and_kill()
            time.sleep(0.001)
        return True

    def _freeze_and_kill(self) -> None:
        # Frozen processes cannot fork, so the pid list read while frozen is complete;
        # SIGKILL is delivered once they are thawed.
        state = self.dirs["freezer"] / "freezer.state"
        with contextlib.suppress(OSError):
            state.write_text("FROZEN")
            for _ in range(200):
                if state.read_text().strip() == "FROZEN":
                    break
                time.sleep(0.001)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            state.write_text("THAWED")

    def remove(self) -> None:
        while self._held:
            os.close(self._held.popitem()[1])
        for d in self.dirs.values():
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the last exiting tasks are unlinked
                    time.sleep(0.002)


def sweep_stale(layout: CgroupLayout) -> int:
    """Tear down groups left by owners that died (e.g. a SIGKILLed server); returns how
    many were removed."""
    names: set[str] = set()
    for base in layout.bases.values():
        with contextlib.suppress(OSError):
            names.update(p.name for p in base.iterdir() if p.is_dir())
    removed = 0
    for name in names:
        owner = name.split("-", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            group = Cgroup(layout, name)
            group.kill_all()
            group.remove()
            removed += 1
    return removed
