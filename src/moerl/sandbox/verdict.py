"""Turn what was observed (exit status, pipes, cgroup counters) into an ExecutionResult."""

from __future__ import annotations

import os
import resource
import signal

from moerl.sandbox.capture import Capture
from moerl.sandbox.cgroups import CgroupStats
from moerl.sandbox.config import Limits
from moerl.sandbox.result import ExecutionResult, ExecutionStatus


def _exit_and_signal(wait_status: int) -> tuple[int | None, int | None]:
    """bubblewrap exits with the program's code, or 128 + N when the program died of
    signal N (so a program's own `exit(137)` reads as SIGKILL: the one ambiguity)."""
    if os.WIFSIGNALED(wait_status):  # bwrap itself was killed (teardown)
        return None, os.WTERMSIG(wait_status)
    code = os.WEXITSTATUS(wait_status)
    if 128 < code < 128 + signal.NSIG:
        return None, code - 128
    return code, None


def classify(
    streams: Capture,
    wait_status: int,
    usage: resource.struct_rusage | None,
    wall: float,
    lim: Limits,
    stats: CgroupStats | None,
) -> ExecutionResult:
    """`usage`: bubblewrap's rusage, None when it is reaped later (the group's counters
    then hold the tree's CPU and memory)."""
    exit_code, sig = _exit_and_signal(wait_status)
    rusage_cpu = usage.ru_utime + usage.ru_stime if usage is not None else 0.0
    cpu = stats.cpu_time_s if stats is not None and stats.cpu_time_s is not None else rusage_cpu
    # ru_maxrss (KiB) is the largest single process, a lower bound for the tree.
    rusage_peak = usage.ru_maxrss * 1024 if usage is not None else None
    peak = stats.peak_memory_bytes if stats is not None else rusage_peak
    hit: list[str] = []
    if streams.timed_out:
        hit.append("wall_time")
    if sig in (signal.SIGXCPU, signal.SIGKILL) and max(cpu, rusage_cpu) >= 0.9 * lim.cpu_time_s:
        hit.append("cpu_time")
    if stats is not None and stats.oom_killed:
        hit.append("memory")
    if stats is not None and stats.pids_limit_hit:
        hit.append("pids")
    if sig == signal.SIGXFSZ:
        hit.append("file_size")
    if streams.output_exceeded:
        hit.append("output")
    started = streams.started.data.startswith(b"S")
    error = None
    if not started and not streams.timed_out:
        status = ExecutionStatus.SANDBOX_ERROR
        said = bytes(streams.bwrap.data) + bytes(streams.stderr.data)
        reason = said[-2000:].decode("utf-8", "replace")
        error = f"bubblewrap did not start the program: {reason}"
    elif streams.output_exceeded:
        status = ExecutionStatus.OUTPUT_LIMIT
    elif streams.timed_out or "cpu_time" in hit:
        status = ExecutionStatus.TIMEOUT
    elif "memory" in hit and exit_code != 0:
        status = ExecutionStatus.MEMORY_LIMIT
    elif exit_code == 0:
        status = ExecutionStatus.OK
    else:
        status = ExecutionStatus.RUNTIME_ERROR
    return ExecutionResult(
        status=status,
        exit_code=exit_code,
        signal=sig,
        stdout=bytes(streams.stdout.data),
        stderr=bytes(streams.stderr.data),
        stdout_truncated=streams.stdout.truncated,
        stderr_truncated=streams.stderr.truncated,
        wall_time_s=wall,
        cpu_time_s=cpu,
        peak_memory_bytes=peak,
        limits_hit=tuple(hit),
        channel=bytes(streams.channel.data) if streams.channel is not None else b"",
        error=error,
    )
