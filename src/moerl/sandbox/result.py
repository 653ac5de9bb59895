"""What one sandboxed execution did."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ExecutionStatus(StrEnum):
    """How an execution ended. Only SANDBOX_ERROR is a failure of the system; every other
    value is something the program did (and may be scored)."""

    OK = "ok"
    RUNTIME_ERROR = "runtime_error"
    COMPILE_ERROR = "compile_error"
    TIMEOUT = "timeout"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"
    SANDBOX_ERROR = "sandbox_error"


@dataclass(frozen=True)
class ExecutionResult:
    status: ExecutionStatus
    exit_code: int | None
    """The program's exit code; None when it was killed by a signal or never started."""
    signal: int | None
    """Signal that ended the program, if any (bubblewrap reports it as 128 + signal)."""
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_time_s: float
    cpu_time_s: float
    """User + system CPU of the whole tree (cgroup accounting; rusage in the weaker mode)."""
    peak_memory_bytes: int | None
    """Peak resident memory of the tree; None where it cannot be measured."""
    limits_hit: tuple[str, ...] = ()
    """Which limits were reached: any of wall_time, cpu_time, memory, pids, file_size, output."""
    channel: bytes = b""
    """Bytes written to the result channel (fd 3), if one was requested."""
    error: str | None = None
    """Why the sandbox itself failed (SANDBOX_ERROR only)."""

    @property
    def is_infra_error(self) -> bool:
        return self.status is ExecutionStatus.SANDBOX_ERROR

    def text(self, stream: str = "stdout") -> str:
        data = self.stdout if stream == "stdout" else self.stderr
        return data.decode("utf-8", errors="replace")


def sandbox_error(message: str, wall_time_s: float = 0.0) -> ExecutionResult:
    return ExecutionResult(
        status=ExecutionStatus.SANDBOX_ERROR,
        exit_code=None,
        signal=None,
        stdout=b"",
        stderr=b"",
        stdout_truncated=False,
        stderr_truncated=False,
        wall_time_s=wall_time_s,
        cpu_time_s=0.0,
        peak_memory_bytes=None,
        error=message,
    )
