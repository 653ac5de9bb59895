"""The asynchronous checkpoint writer: a process per rank that lives and dies with the
rank, outlasts the SIGUSR1 that asks for a checkpoint, reports a death instead of
hanging, and runs at SCHED_IDLE; the staged copy it reads is in shared memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from moerl.checkpoint.async_writer import HOLD_ENV, stage
from moerl.checkpoint.writer_process import WriterProcess, lower_own_priority

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="per-thread policy and parent-death signals are Linux's")


def _report_priority(rank: int, buckets: object, outcome: object) -> None:
    policy = os.sched_getscheduler(0)
    outcome.put({"rank": rank, "policy": policy, "pid": os.getpid()})  # type: ignore[attr-defined]


def _die(rank: int, buckets: object, outcome: object) -> None:
    os._exit(3)


def _sum_staged(rank: int, buckets: list, outcome: object) -> None:
    total = sum(float(t.sum()) for _, _, (_, tensors) in buckets for _, t in tensors)
    outcome.put(total)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def writer() -> Iterator[WriterProcess]:
    process = WriterProcess(HOLD_ENV)
    yield process
    process.close()


@linux_only
def test_writer_thread_runs_idle_and_the_rank_keeps_its_policy() -> None:
    seen: dict[str, int | str] = {}

    def lower() -> None:
        seen["got"] = lower_own_priority()
        seen["policy"] = os.sched_getscheduler(threading.get_native_id())

    before = os.sched_getscheduler(0)
    thread = threading.Thread(target=lower)
    thread.start()
    thread.join()
    assert seen == {"got": "idle", "policy": os.SCHED_IDLE}
    assert os.sched_getscheduler(0) == before != os.SCHED_IDLE


@linux_only
def test_the_process_writes_at_idle_priority_and_reads_the_shared_copy(
        writer: WriterProcess) -> None:
    writer.submit((_report_priority, (5, None), {}, None))
    done, report = writer.outcome(block=True)
    assert done and report["rank"] == 5 and report["policy"] == os.SCHED_IDLE
    assert report["pid"] != os.getpid()
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    staged = stage([("f", "k", ([], [("item", tensor)]))])
    copy = staged[0][2][1][0][1]
    assert copy.is_shared() and torch.equal(copy, tensor)
    tensor.add_(100)  # training moves on: the staged copy is what gets written
    writer.submit((_sum_staged, (0, staged), {}, None))
    assert writer.outcome(block=True) == (True, float(sum(range(12))))


def test_a_writer_that_dies_reports_an_error_instead_of_hanging() -> None:
    writer = WriterProcess(HOLD_ENV)
    try:
        writer.submit((_die, (0, None), {}, None))
        done, outcome = writer.outcome(block=True)
    finally:
        writer.close()
    assert done and isinstance(outcome, RuntimeError)
    assert "exit code 3" in str(outcome)


@linux_only
def test_sigusr1_leaves_the_writer_running(writer: WriterProcess) -> None:
    writer.submit((_report_priority, (0, None), {}, None))
    assert writer.outcome(block=True)[0]  # it is up and serving
    os.kill(writer.process.pid, signal.SIGUSR1)
    time.sleep(0.3)
    assert writer.process.is_alive()


@linux_only
def test_the_writer_dies_with_its_rank(tmp_path: Path) -> None:
    pid_file = tmp_path / "writer.pid"
    rank = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from moerl.checkpoint.writer_process import WriterProcess
        writer = WriterProcess("UNUSED")
        open({str(pid_file)!r}, "w").write(str(writer.process.pid))
        time.sleep(600)
    """)])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the rank never started its writer"
            time.sleep(0.1)
        child = psutil.Process(int(pid_file.read_text()))
        rank.kill()  # SIGKILL: no teardown of its own runs
        child.wait(timeout=30)  # raises if the writer outlives the rank
    finally:
        rank.kill()
        rank.wait()


@pytest.mark.parametrize("shape", [(3, 4, 5), (), (7,), (2, 0, 3)])
def test_a_staged_tensor_is_contiguous_and_shared(shape: tuple[int, ...]) -> None:
    from moerl.checkpoint.async_writer import shared_empty

    made, reference = shared_empty(torch.Size(shape), torch.bfloat16), torch.empty(shape)
    assert made.is_shared() and made.dtype == torch.bfloat16
    assert (made.shape, made.stride()) == (reference.shape, reference.stride())


def test_the_next_save_stages_into_the_last_saves_memory() -> None:
    from moerl.checkpoint.async_writer import StagingBuffers

    buffers = StagingBuffers()
    weights, moments = torch.ones(4, 3), torch.zeros(5)

    def plan(*tensors: torch.Tensor) -> list:
        return [("f", "k", ([], [(f"item{i}", t) for i, t in enumerate(tensors)]))]

    def pointers(staged: list) -> list[int]:
        return [t.data_ptr() for _, t in staged[0][2][1]]

    first = pointers(stage(plan(weights, moments), buffers))
    weights.add_(1)
    again = stage(plan(weights, moments), buffers)
    assert pointers(again) == first  # the same shared memory, refilled
    assert torch.equal(again[0][2][1][0][1], weights)
    grown = pointers(stage(plan(torch.ones(4, 4), moments), buffers))
    assert grown[0] != first[0] and grown[1] == first[1]
    stage(plan(weights), buffers)
    assert len(buffers.buffers) == 1  # a tensor the plan lost is freed
