"""Which stage started each sandbox of a run: a thread that polls the process table
while the run lives and, for every bubblewrap process it sees, names the stage whose
process it descends from (by that ancestor's command line)."""

from __future__ import annotations

import threading
import time
from types import TracebackType

import psutil

# an ancestor's command line -> the stage it is
STAGES = (("serve env", "environment"), ("serve reward", "reward"), ("cli trainer", "trainer"))


def owner(proc: psutil.Process) -> str:
    for parent in proc.parents():
        try:
            line = " ".join(parent.cmdline())
        except psutil.Error:
            continue
        for marker, stage in STAGES:
            if marker in line:
                return stage
    return "other"


class SandboxOwners:
    """`with SandboxOwners() as seen:` ... then `seen.stages`: stage -> bwrap pids."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.stages: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> SandboxOwners:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _poll(self) -> None:
        seen: set[int] = set()
        while not self._stop.is_set():
            for proc in psutil.process_iter(["name"]):
                if proc.info["name"] != "bwrap" or proc.pid in seen:
                    continue
                try:
                    stage = owner(proc)
                except psutil.Error:
                    continue
                seen.add(proc.pid)
                self.stages.setdefault(stage, set()).add(proc.pid)
            time.sleep(self.interval_s)
