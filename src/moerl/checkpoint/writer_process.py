"""The process that writes a rank's asynchronous saves: one per rank, started once.

The rank stages its shard into shared memory (`async_writer.stage`) and hands the
write to this process through a queue: the tensors travel as shared-memory handles,
not as bytes, so the staged copy is the only one. The process serialises, hashes and
writes with an interpreter and a GIL of its own, so nothing of the write runs in the
rank's Python between its training calls; it runs at SCHED_IDLE, so it takes a core
only while no training thread wants one.

It is spawned (a fresh interpreter: nothing of the rank's memory is shared or copied
on write), with SIGUSR1 and SIGINT ignored from its first instruction (SLURM delivers
a step's signal to every process of the step, and the USR1 that asks for a checkpoint
must not kill its writer), and it gets SIGKILL when the rank dies, however it dies.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing

from moerl.parent_death import die_with_parent
from moerl.signals import main_not_reimported

# What the process serves: (write function, (rank, staged buckets), kwargs, hold path).
Request = tuple[Callable[..., None], tuple[Any, ...], dict[str, Any], str | None]
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGINT)
CLOSE_TIMEOUT_S = 30.0

WRITER_NICENESS = 19


def lower_own_priority() -> str:
    """Put the calling thread (not its process) at the lowest CPU priority: Linux's
    SCHED_IDLE, else nice 19; the policy it got ("idle", "nice" or "unchanged")."""
    tid = threading.get_native_id()
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICENESS)
        return "nice"
    return "unchanged"  # elsewhere than Linux a thread shares its process's priority


def _serve(requests: Any, results: Any, parent_pid: int, hold_env: str) -> None:
    """The writer process: each request's write, its outcome back on `results`."""
    die_with_parent(parent_pid, signal.SIGKILL)
    lower_own_priority()
    torch.set_num_threads(1)  # serialising and hashing need no thread pool
    while (request := requests.get()) is not None:
        write, args, kwargs, hold = request
        if hold is None:
            os.environ.pop(hold_env, None)
        else:
            os.environ[hold_env] = hold
        outcome: queue.Queue[Any] = queue.Queue()
        write(*args, outcome, **kwargs)
        results.put(outcome.get())
        del request, write, args  # the staged copy's shared memory goes with them


class WriterProcess:
    """One rank's writer process and its two queues; writes run one at a time."""

    def __init__(self, hold_env: str) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self.requests = context.Queue()
        self.results = context.Queue()
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in IGNORED_SIGNALS}
        try:  # an ignored disposition is inherited, and survives the spawn's exec
            with main_not_reimported():
                self.process = context.Process(
                    target=_serve, args=(self.requests, self.results, os.getpid(), hold_env),
                    name="checkpoint-writer", daemon=True)
                self.process.start()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def submit(self, request: Request) -> None:
        self.requests.put(request)

    def outcome(self, block: bool) -> tuple[bool, Any]:
        """(True, what the write reported) once it has; (False, None) while it runs.
        A process that died without reporting reports an error instead of hanging."""
        while True:
            try:
                return True, self.results.get(timeout=1.0 if block else 0.0)
            except queue.Empty:
                if not self.process.is_alive():
                    return True, RuntimeError(
                        f"the checkpoint writer process ended (exit code "
                        f"{self.process.exitcode}) without reporting its write")
                if not block:
                    return False, None

    def close(self) -> None:
        if self.process.is_alive():
            self.requests.put(None)
            self.process.join(CLOSE_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
