"""Watching a run's SLURM job from a test: its logs, metrics and state, and failing
with all of them when something does not happen in time."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster


def tail(path: Path | None, chars: int = 3000) -> str:
    if path is None or not path.is_file():
        return f"<no {path}>"
    return f"--- {path.name}:\n{path.read_text(errors='replace')[-chars:]}"


def metric_rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return rows


def trained_steps(run: Path) -> list[int]:
    return [int(r["step"]) for r in metric_rows(run) if "train/loss" in r]


class RunWatch:
    """A run's job and where it writes; `proc`: the `moerl train` that submitted it
    (None when the test submitted the script itself)."""

    def __init__(self, run: Path, proc: subprocess.Popen[bytes] | None = None,
                 out: Path | None = None) -> None:
        self.run, self.proc, self.out = run, proc, out
        self.job: int | None = None

    def batch_log(self) -> Path | None:
        found = sorted((self.run / "logs").glob("slurm-*.out"))
        return found[0] if found else None

    def trainer_log(self) -> Path | None:
        found = sorted((self.run / "logs").glob("trainer-*.log"))
        return found[0] if found else None

    def logs(self, stage: str) -> list[Path]:
        return sorted((self.run / "logs").glob(f"{stage}-*.log"))

    def diagnostics(self, cluster: SlurmCluster) -> str:
        state = cluster.run("scontrol", "show", "job", str(self.job), check=False).stdout
        return "\n".join([
            f"job {self.job}: {state[:2000]}", tail(self.out, 2000), tail(self.batch_log()),
            tail(self.trainer_log(), 4000), tail(cluster.root / "slurmctld.log", 3000),
        ])  # fmt: skip

    def until(self, cond: Callable[[], bool], timeout: float, what: str,
              cluster: SlurmCluster) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} after {timeout:.0f} s\n{self.diagnostics(cluster)}")
            time.sleep(0.5)
