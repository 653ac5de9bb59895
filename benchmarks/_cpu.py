"""CPU seconds of a process tree, read from /proc (Linux): a measure of work that other
load on a shared machine changes far less than wall time does.

Not a benchmark (the leading underscore keeps it out of the smoke test's list).
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return out


def _seconds(pid: int) -> tuple[float, str] | None:
    """(user + system CPU seconds of the process and of its children it has waited for,
    its command line)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return ticks / _TICK, " ".join(a.decode(errors="replace") for a in argv if a)


Reading = dict[int, tuple[float, list[str]]]  # pid -> (CPU s, its and its ancestors' argv)


def tree_cpu(root: int) -> Reading:
    """Every process of `root`'s tree: its CPU seconds and the command lines of itself
    and of the processes above it, nearest first."""
    found: Reading = {}
    todo: list[tuple[int, list[str]]] = [(root, [])]
    while todo:
        pid, above = todo.pop()
        got = _seconds(pid)
        if got is None:
            continue
        lines = [got[1], *above]
        found[pid] = (got[0], lines)
        todo += [(child, lines) for child in _children(pid)]
    return found


def per_stage(before: Reading, after: Reading, stages: dict[str, str]) -> dict[str, float]:
    """CPU seconds spent between two `tree_cpu` readings, summed per stage: a process
    counts for the stage whose marker the nearest command line (its own, then its
    parent's, ...) holds; "other" when none does (the launcher, torchrun's agent). A
    process that ended in between counts only through the parent that waited for it."""
    out = dict.fromkeys([*stages, "other"], 0.0)
    for pid, (seconds, lines) in after.items():
        spent = seconds - before.get(pid, (0.0, []))[0]
        stage = next((name for line in lines for name, marker in stages.items()
                      if marker in line), "other")
        out[stage] += max(spent, 0.0)
    return out


class StepCpu:
    """CPU seconds of each RL step of a run, all its processes together and the reward
    server's: a reading of the processes' trees each time the run reports something
    (`mark`), an interval counted when what it reported is one RL step (not an
    evaluation, nor a step and an evaluation together)."""

    def __init__(self) -> None:
        self.total: list[float] = []
        self.reward: list[float] = []
        self._last: Reading | None = None

    def mark(self, roots: list[int], kinds: list[str]) -> None:
        """`kinds`: what was reported since the last mark ("step" or "eval")."""
        reading: Reading = {}
        for root in roots:
            reading |= tree_cpu(root)
        if self._last is not None and kinds == ["step"]:
            spent = per_stage(self._last, reading, {"reward": "serve reward"})
            self.total.append(sum(spent.values()))
            self.reward.append(spent["reward"])
        self._last = reading
