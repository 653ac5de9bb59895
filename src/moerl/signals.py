"""Stop cleanly on SIGTERM / SIGUSR1: finish the step, checkpoint, exit for requeue.

SLURM sends SIGUSR1 (`--signal=USR1@<seconds>`) some time before the time limit
and SIGTERM at preemption. The handler only records the signal: the training
loop asks `agreed()` after each step, which all-reduces the flag (max) over the
ranks, so every rank stops after the same step even if the signal reached only
some of them, or reached them during different steps. The loop then checkpoints
and exits with `rendezvous.REQUEUE_EXIT_CODE`, which makes the SLURM
script requeue the job.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.managers import SyncManager
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from moerl.parent_death import die_with_parent_and_preload

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


_helper_manager: SyncManager | None = None


def start_helpers_ignoring(signals: tuple[signal.Signals, ...] = ()) -> None:
    """Start the process-wide helper of megatron-core's checkpoint writer (the
    multiprocessing Manager behind its results queue) with `signals` ignored, and
    bound to this process's life. Does nothing once it runs.

    SLURM delivers a job step's signal to every process of the step (proctrack/cgroup),
    helpers included; a helper that dies of SIGUSR1 breaks the very checkpoint the
    signal asks for (BrokenPipeError on the next save). An ignored disposition is
    inherited by the helper and survives its exec; ours is restored afterwards.
    Megatron would start the Manager itself, one that outlives a SIGKILLed trainer
    (with multiprocessing's resource tracker, which waits for it); ours gets the
    parent-death signal and is the one megatron's `get_write_results_queue` returns.
    """
    global _helper_manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        with _main_not_reimported():
            # In the helper: die with us; import what unpickling the writer's results
            # needs (torch) in the background, so that the first save need not wait.
            manager.start(initializer=die_with_parent_and_preload,
                          initargs=(os.getpid(), signal.SIGKILL, ("torch.distributed.checkpoint",)))
        _helper_manager = manager
        filesystem_async._results_queue = manager.Queue()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _main_not_reimported() -> Iterator[None]:
    """A spawned child imports the parent's `__main__` again (a trainer's: torch and
    Megatron, ~4 s on 2 cores) unless the module names no spec and no file. The Manager
    needs none of it: its server unpickles only multiprocessing's types and the
    initializer (0.05 s)."""
    main = sys.modules["__main__"]
    saved = {name: getattr(main, name) for name in ("__spec__", "__file__") if hasattr(main, name)}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


class StopOnSignal:
    """Context manager: while inside, the stop signals set a flag instead of killing."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if self.signals:
            start_helpers_ignoring(self.signals)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        """This rank has received a stop signal (no communication)."""
        return self.received is not None

    def agreed(self, group: dist.ProcessGroup | None = None) -> bool:
        """Whether any rank has been signalled (collective: every rank must call it)."""
        flag = torch.tensor([int(self.requested)], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            if torch.cuda.is_available():
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        stop = bool(flag.item())
        if stop and (not dist.is_initialized() or dist.get_rank() == 0):
            name = self.received.name if self.received else "a stop signal on another rank"
            print(f"stopping after this step: {name}", file=sys.stderr, flush=True)
        return stop
