"""Starting a test worker script as one process or as several ranks (gloo).

The ranks of a job are forked from one server process that has already imported
torch, Megatron and the model code (multiprocessing's forkserver with a preload),
and each gets the environment torchrun gives its workers (RANK, WORLD_SIZE,
MASTER_ADDR, ...). A job then costs its own work, not each rank importing
Megatron again: on 2 cores a 2-rank parity job took ~29 s under torchrun and ~5 s
forked. Nothing else differs for the worker: it initialises torch.distributed
from that environment as under torchrun, in a fresh process of its own. The real
torchrun path is what `moerl train` and the CLI tests run.

The workers import `moerl` from this checkout's `src/` and run single-threaded so
that several ranks share a small machine; rank 0 writes its results to `out`
(JSON), which `run_worker` returns.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import sys
import time
from multiprocessing.context import ForkServerContext, ForkServerProcess
from pathlib import Path
from typing import Any

import pytest

from moerl.ports import free_port

SRC = Path(__file__).resolve().parents[2] / "src"

# What the ranks would otherwise each import at start-up.
PRELOAD = [
    "torch", "torch.distributed", "megatron.core", "megatron.core.optimizer",
    "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing",
    "moerl.models.build", "moerl.models.weights", "moerl.parallel.groups",
    "moerl.trainer.optimizer", "moerl.trainer.step",
]
_context: ForkServerContext | None = None


def worker_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    return env


def worker_command(script: Path, ranks: int, args: list[str]) -> list[str]:
    """The torchrun command line of a job (for tests that start and signal it)."""
    if ranks == 1:
        return [sys.executable, str(script), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", str(script), *args]


def _forkserver() -> ForkServerContext:
    global _context
    if _context is None:
        if str(SRC) not in sys.path:
            sys.path.insert(0, str(SRC))
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _context = context
    return _context


def _rank_main(script: str, args: list[str], env: dict[str, str], log: str) -> None:
    """One rank: its output to `log`, torchrun's environment, then the script as __main__."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 at start-up would
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")


def _rank_env(rank: int, ranks: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in worker_env().items() if k != "PYTHONPATH"}
    if ranks == 1:
        return env
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def _wait(procs: list[ForkServerProcess], timeout: float) -> str | None:
    """None when every rank exited 0; else why not (the other ranks are stopped)."""
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        failed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            for p in procs:
                p.join()
            return (f"rank {failed[0]} exited {procs[failed[0]].exitcode}" if failed
                    else f"timed out after {timeout:.0f} s")
        time.sleep(0.05)
    codes = [p.exitcode for p in procs]
    return None if all(c == 0 for c in codes) else f"exit codes {codes}"


def run_worker(script: Path, ranks: int, args: list[str], out: Path | None = None,
               timeout: int = 300) -> Any:
    """Run `script args` on `ranks` ranks; its JSON from `out` (None without `out`).

    A failing worker fails the test with the last lines of its ranks' output.
    """
    context = _forkserver()
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    port = free_port()
    paths = [logs / f"{script.stem}.{os.getpid()}.{port}.rank{r}.log" for r in range(ranks)]
    procs = [context.Process(target=_rank_main,
                             args=(str(script), args, _rank_env(r, ranks, port), str(path)))
             for r, path in enumerate(paths)]
    for proc in procs:
        proc.start()
    problem = _wait(procs, timeout)
    texts = [path.read_text(errors="replace") if path.exists() else "" for path in paths]
    for path in paths:
        path.unlink(missing_ok=True)
    if problem is not None:
        tail = "\n".join(f"[rank {r}] {line}" for r, text in enumerate(texts)
                         for line in text.splitlines()[-25:])
        pytest.fail(f"{script.name} {args} on {ranks} ranks failed ({problem}):\n{tail}")
    return None if out is None else json.loads(out.read_text())
