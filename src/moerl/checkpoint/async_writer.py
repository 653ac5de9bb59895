"""Asynchronous saves: the rank's shard staged in shared memory, written by a process.

When an asynchronous save starts, each rank copies exactly what it is to write (its
shard of the checkpoint: the tensors of its write plan) into shared memory, hands
that copy to its writer process (`writer_process.WriterProcess`, started with the
first save) and goes back to training; the next optimizer step may change the
weights in place, the copy is what was saved. Its extra host memory is that copy, the
size of its shard (on a GPU the same copy is the device-to-host one every
asynchronous save needs), freed once the write is done; the process receives it as
shared-memory handles, not bytes.

Megatron-core's own caller forks the rank instead: the child sees the state as it
was through copy-on-write, and every page the training then writes is duplicated,
which on a host holding the model is the rank's whole memory, not its shard; and a
child outlives a rank killed with SIGKILL. A writer thread in the rank avoids both,
but shares the rank's GIL: the serialisation's Python runs between the training's
own calls, and a thread of the lowest priority that holds the GIL makes the training
wait for it (`benchmarks/checkpoint_overlap.py` measured a step 1.25-1.45x slower
with the write in flight, against 1.0-1.1x with the writer a process of its own).

`WriterCallsQueue` is Megatron's `AsyncCallsQueue` (requests, finalisation once every
rank is done, errors raised on every rank) with this caller in place of the fork.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
)

from moerl.checkpoint.writer_process import WriterProcess

# A writer that waits for this file before it writes: the tests' way to hold a save
# in flight for as long as they look (no timing decides when it ends).
HOLD_ENV = "MOERL_CHECKPOINT_HOLD"


def shared_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in shared memory (no private copy is made first)."""
    strides: list[int] = []
    numel = 1
    for size in reversed(shape):  # contiguous: the last dimension's stride is 1
        strides.insert(0, numel)
        numel *= max(size, 1)
    if 0 in shape:
        numel = 0
    storage = torch.UntypedStorage._new_shared(numel * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, strides)


class StagingBuffers:
    """The shared memory one rank stages its saves in, kept from one save to the next.

    A rank's write plan is the same at every save of a run (its shard does not change
    shape), so the second save copies into memory the first one faulted in, instead
    of asking the kernel for the shard's size in fresh shared pages again; a tensor
    whose shape or dtype differs from the last save's gets new memory. At most one
    save is in flight (its write is done before the next save stages), so no write
    reads a buffer being refilled. What a rank holds between saves is one shard."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def take(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """Buffer `index` of the plan, shaped like `like` (reused when it already is)."""
        if index < len(self.buffers):
            kept = self.buffers[index]
            if kept.shape == like.shape and kept.dtype == like.dtype:
                return kept
            self.buffers[index] = shared_empty(like.shape, like.dtype)
        else:
            self.buffers.append(shared_empty(like.shape, like.dtype))
        return self.buffers[index]

    def drop_beyond(self, count: int) -> None:
        """Free the buffers of tensors the last plan no longer had."""
        del self.buffers[count:]


def stage(write_buckets: list[Any], buffers: StagingBuffers | None = None) -> list[Any]:
    """Megatron's write plan with every tensor copied into shared memory of its own
    (`buffers`' when given, else fresh).

    A bucket is (file path, storage key, (byte items, [(item, tensor), ...])); bytes
    items are serialised already, tensors may be views of live training state."""
    buffers = buffers if buffers is not None else StagingBuffers()
    staged, index = [], 0
    for path, key, (bytes_data, tensor_data) in write_buckets:
        copies = []
        for item, tensor in tensor_data:
            copies.append((item, buffers.take(index, tensor).copy_(tensor)))
            index += 1
        staged.append((path, key, (bytes_data, copies)))
    buffers.drop_beyond(index)
    return staged


def staged_bytes(write_buckets: list[Any]) -> int:
    return sum(t.nbytes for _, _, (_, tensors) in write_buckets for _, t in tensors)


class ProcessAsyncCaller(AsyncCaller):
    """Runs one request's write in the rank's writer process (`WriterProcess`)."""

    def __init__(self, writer: WriterProcess) -> None:
        self.writer = writer
        self.report: Any = None  # the finalisation's results queue: filled once written
        self.staged: Any = None  # kept alive while the process reads it

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return  # nothing of this rank's to write
        rank, buckets, self.report = async_req.async_fn_args
        if async_req.preload_fn is not None:
            buckets = async_req.preload_fn()  # the staged copy, in shared memory
        self.staged = buckets
        self.writer.submit((async_req.async_fn, (rank, buckets), async_req.async_fn_kwargs,
                            os.environ.get(HOLD_ENV)))

    def _written(self, block: bool) -> bool:
        if self.report is None:
            return True
        done, outcome = self.writer.outcome(block)
        if done:
            self.report.put(outcome)
            self.report = self.staged = None
        return done

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        alive = int(not self._written(block=False))
        done = not alive if no_dist else bool(self.sync_all_async_calls(alive))
        if done or blocking:
            self.close()
            done = True
        return done

    def close(self, abort: bool = False) -> None:
        self._written(block=True)  # a process cannot drop a write half done either

    def in_flight(self) -> bool:
        return self.report is not None and not self._written(block=False)

    def __del__(self) -> None:
        pass


class WriterCallsQueue(AsyncCallsQueue):
    """Megatron's queue of async saves, each written by this rank's writer process
    (started with the first save, closed with the queue)."""

    def __init__(self) -> None:
        super().__init__()
        self._writer: WriterProcess | None = None

    def _get_async_caller(self) -> ProcessAsyncCaller:
        if self._writer is None:
            self._writer = WriterProcess(HOLD_ENV)
        return ProcessAsyncCaller(self._writer)

    def writing(self) -> bool:
        """Is a write of this rank still running?"""
        return any(isinstance(call.async_caller, ProcessAsyncCaller)
                   and call.async_caller.in_flight() for call in self.async_calls)

    def close(self, abort: bool = False) -> None:
        super().close(abort)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
