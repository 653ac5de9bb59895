"""The background writer of asynchronous saves: a staged copy, written by a thread.

When an asynchronous save starts, each rank copies exactly what it is to write (its
shard of the checkpoint: the tensors of its write plan) into host memory it alone
owns, hands that copy to a writer thread and goes back to training; the next
optimizer step may change the weights in place, the copy is what was saved. Its extra
host memory is that copy, the size of its shard (on a GPU the same copy is the
device-to-host one every asynchronous save needs), freed once the write is done.

Megatron-core's own caller forks the rank instead: the child sees the state as it
was through copy-on-write, and every page the training then writes is duplicated,
which on a host holding the model is the rank's whole memory, not its shard; and a
child outlives a rank killed with SIGKILL. A thread shares the rank's fate and its
memory. The file writes and the hashing release the GIL, and the thread runs at the
lowest CPU priority Linux has, SCHED_IDLE (threads are scheduled apart): it gets a
core only while no training thread wants it, and a training thread that wakes takes
the core back at once. A nice-19 thread, the fallback, is only weighted down: a
woken training thread may wait for the rest of its slice, and a step whose threads
meet at a barrier after every parallel region waits with it. Where the step itself
uses every host core (a CPU rank), the write still slows it through what nice cannot
schedule: memory bandwidth and the page cache (`benchmarks/checkpoint_overlap.py`
measures by how much).

`ThreadCallsQueue` is Megatron's `AsyncCallsQueue` (requests, finalisation once every
rank is done, errors raised on every rank) with this caller in place of the fork.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
)


def stage(write_buckets: list[Any]) -> list[Any]:
    """Megatron's write plan with every tensor copied into host memory of its own.

    A bucket is (file path, storage key, (byte items, [(item, tensor), ...])); bytes
    items are serialised already, tensors may be views of live training state."""
    staged = []
    for path, key, (bytes_data, tensor_data) in write_buckets:
        copies = [(item, torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t))
                  for item, t in tensor_data]
        staged.append((path, key, (bytes_data, copies)))
    return staged


def staged_bytes(write_buckets: list[Any]) -> int:
    return sum(t.nbytes for _, _, (_, tensors) in write_buckets for _, t in tensors)


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


def _at_lowest_priority(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, run by a thread that first lowers its own CPU priority (not the rank's)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        lower_own_priority()
        return fn(*args, **kwargs)
    return run


class ThreadAsyncCaller(AsyncCaller):
    """Runs one request's write in a thread of this rank."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return  # nothing of this rank's to write
        args = list(async_req.async_fn_args)
        if async_req.preload_fn is not None:
            args[1] = async_req.preload_fn()  # the staged copy: the thread's alone
        self.thread = threading.Thread(target=_at_lowest_priority(async_req.async_fn), args=args,
                                       kwargs=async_req.async_fn_kwargs,
                                       name="checkpoint-writer", daemon=True)
        self.thread.start()

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        alive = int(self.thread is not None and self.thread.is_alive())
        done = not alive if no_dist else bool(self.sync_all_async_calls(alive))
        if done or blocking:
            self.close()
            done = True
        return done

    def close(self, abort: bool = False) -> None:
        if self.thread is not None:
            self.thread.join()  # a thread cannot be killed: it ends with its write
            self.thread = None

    def in_flight(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def __del__(self) -> None:
        pass


class ThreadCallsQueue(AsyncCallsQueue):
    """Megatron's queue of async saves, each written by a `ThreadAsyncCaller`."""

    def _get_async_caller(self) -> ThreadAsyncCaller:
        return ThreadAsyncCaller()

    def writing(self) -> bool:
        """Is a write of this rank still running?"""
        return any(isinstance(call.async_caller, ThreadAsyncCaller)
                   and call.async_caller.in_flight() for call in self.async_calls)
