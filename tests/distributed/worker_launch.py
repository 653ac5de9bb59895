"""Starting a test worker script as one plain process or under torchrun (gloo).

The workers import `moerl` from this checkout's `src/` and run single-threaded so that
several ranks share a small machine; rank 0 writes its results to `out` (JSON), which
`run_worker` returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def worker_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    return env


def worker_command(script: Path, ranks: int, args: list[str]) -> list[str]:
    if ranks == 1:
        return [sys.executable, str(script), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", str(script), *args]


def run_worker(script: Path, ranks: int, args: list[str], out: Path | None = None,
               timeout: int = 300) -> Any:
    """Run `script args` on `ranks` ranks; its JSON from `out` (None without `out`).

    A failing worker fails the test with the last lines of its output.
    """
    proc = subprocess.run(worker_command(script, ranks, args), env=worker_env(),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        pytest.fail(f"{script.name} {args} on {ranks} ranks failed:\n{tail}")
    return None if out is None else json.loads(out.read_text())
