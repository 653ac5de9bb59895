"""Signalling a stage's processes: its process group, and what left the group.

Each local stage process leads its own process group, which reaches most of what
it forks. Not all of it: torchrun starts every rank with `start_new_session`, so
a rank whose torchrun was SIGKILLed would outlive the run. The launcher therefore
also records each stage's descendants (by parent pid, from /proc) before it
signals anything, and kills those that remain after the grace period.
"""

from __future__ import annotations

import os
import signal
from contextlib import suppress
from pathlib import Path

_PROC = Path("/proc")


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether any process is left in group `pgid`; a zombie leader still counts,
    so callers reap it first."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after "pid (comm) ", as fields: state, ppid, ...; comm may
    hold spaces and parentheses, hence the last ")"."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return []
    return stat[stat.rfind(")") + 2 :].split()


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of `pid` -> its start time (none without /proc).

    The start time tells a descendant from a later process given the same pid.
    """
    if not _PROC.is_dir():
        return {}
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if len(fields) > 19:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
                starts[int(entry.name)] = fields[19]
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def children(pid: int) -> list[int]:
    """The live direct children of `pid` (e.g. torchrun's ranks, not what they fork)."""
    if not _PROC.is_dir():
        return []
    found = []
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if len(fields) > 1 and fields[1] == str(pid) and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def still_running(snapshot: dict[int, str]) -> list[int]:
    """The pids of `snapshot` that are the same processes and not zombies."""
    alive = []
    for pid, start in snapshot.items():
        fields = _stat(pid)
        if len(fields) > 19 and fields[19] == start and fields[0] != "Z":
            alive.append(pid)
    return alive


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
