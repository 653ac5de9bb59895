"""One execution in two halves: `launch` starts bubblewrap in the execution's cgroup
with its pipes, `finish` feeds stdin, collects until exit and tears the tree down.

`Sandbox.run` calls both at once. A warm slot (warm.py) is a launch done ahead of
time: bwrap and its namespaces are set up and the starter inside waits on a gate
pipe for the go byte before it execs the program (or, for a program that reads
nothing but its stdin before it acts, the program is already running and waiting
for that stdin). Either way no input of the execution exists before `finish`, and
the wall-clock limit counts from `finish`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moerl.sandbox import capture
from moerl.sandbox.bwrap import (
    LAUNCH_ENV,
    bwrap_argv,
    drop_privileges_argv,
    launcher_argv,
    starter_argv,
)
from moerl.sandbox.cgroups import Cgroup, CgroupLayout
from moerl.sandbox.config import Limits, SandboxConfig
from moerl.sandbox.result import ExecutionResult, sandbox_error
from moerl.sandbox.verdict import classify
from moerl.sandbox.workspace import Workspace

_CHANNEL_CAP = 8 << 20


@dataclass
class Launched:
    """A started execution whose program has not been given its input yet."""

    proc: subprocess.Popen[bytes]
    pid_fd: int
    streams: capture.Capture
    limits: Limits
    group: Cgroup | None
    gate_fd: int | None
    """Write end of the starter's gate; None when the program starts at once."""

    def wait_started(self, timeout_s: float) -> bool:
        """Block until the starter inside reports bwrap's set-up done (the byte is kept
        for `finish`); False on EOF or timeout."""
        fd = self.streams.started.fd
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            return False
        byte = os.read(fd, 1)
        self.streams.started.data += byte
        return bool(byte)

    def exited(self) -> bool:
        """Whether bwrap has exited already (without reaping it)."""
        return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def kill(self) -> None:
        """Tear the whole tree down."""
        if self.group is not None:
            self.group.kill_all()
        else:  # bwrap is pid 1 of the namespace: its death takes every process with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)


def new_group(layout: CgroupLayout | None, run_id: int, lim: Limits) -> Cgroup | None:
    """The execution's cgroup with its limits; None without cgroups. Raises OSError."""
    if layout is None:
        return None
    group = Cgroup(layout, f"{os.getpid()}-{run_id}-{secrets.token_hex(4)}")
    try:
        group.create(lim.memory_mb << 20, lim.max_processes)
    except OSError:
        group.remove()
        raise
    return group


def launch(
    config: SandboxConfig,
    seccomp: bytes,
    argv: Sequence[str],
    workspace: Workspace,
    lim: Limits,
    group: Cgroup | None,
    *,
    channel: bool,
    binds: Sequence[tuple[Path, str]],
    gated: bool,
) -> Launched | ExecutionResult:
    """Start bwrap for `argv`; a sandbox error result when it cannot be started."""
    seccomp_fd = os.memfd_create("moerl-seccomp")
    os.write(seccomp_fd, seccomp)
    os.lseek(seccomp_fd, 0, os.SEEK_SET)
    started_r, started_w = os.pipe()
    chan_r, chan_w = os.pipe() if channel else (None, None)
    gate_r, gate_w = os.pipe() if gated else (None, None)
    command = bwrap_argv(
        config, workspace.path, starter_argv(started_w, chan_w, argv, gate_fd=gate_r),
        seccomp_fd=seccomp_fd, extra_ro_binds=binds,
    )  # fmt: skip
    procs = group.procs_files() if group is not None else []
    passed = tuple(fd for fd in (seccomp_fd, started_w, chan_w, gate_r) if fd is not None)
    try:
        proc = subprocess.Popen(
            launcher_argv(procs, lim, [*drop_privileges_argv(config), *command]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=passed, env=dict(LAUNCH_ENV), close_fds=True, cwd="/",
        )  # fmt: skip
    except OSError as exc:
        for fd in (*passed, started_r, chan_r, gate_w):
            if fd is not None:
                os.close(fd)
        return sandbox_error(f"cannot start bubblewrap: {exc}")
    for fd in passed:
        os.close(fd)
    assert proc.stdout is not None and proc.stderr is not None
    streams = capture.new_capture(
        proc.stdout.fileno(), proc.stderr.fileno(), started_r, chan_r,
        lim.max_output_bytes, _CHANNEL_CAP,
    )  # fmt: skip
    return Launched(proc, os.pidfd_open(proc.pid), streams, lim, group, gate_w)


def finish(launched: Launched, stdin: bytes) -> ExecutionResult:
    """Open the gate, feed `stdin`, collect until exit or the wall-clock limit, reap."""
    proc, streams, lim = launched.proc, launched.streams, launched.limits
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    start = time.monotonic()
    try:
        if launched.gate_fd is not None:
            with contextlib.suppress(BrokenPipeError):  # the starter died: collect says why
                os.write(launched.gate_fd, b"G")
            os.close(launched.gate_fd)
            launched.gate_fd = None
        stdin_fd = os.dup(proc.stdin.fileno())
        proc.stdin.close()
        capture.collect(
            pid_fd=launched.pid_fd, stdin_fd=stdin_fd, stdin_data=stdin, streams=streams,
            deadline=start + lim.wall_time_s, kill=launched.kill,
        )  # fmt: skip
        if not launched.exited():  # collection ended without an exit: a stuck teardown
            launched.kill()
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        # wait4 rather than Popen.wait: it also returns the tree's rusage.
        _, wait_status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        wall = time.monotonic() - start
    finally:
        close(launched)
    stats = launched.group.stats() if launched.group is not None else None
    return classify(streams, wait_status, usage, wall, lim, stats)


def close(launched: Launched) -> None:
    """Release the host side's fds (the process is reaped or about to be)."""
    for fd in (launched.pid_fd, launched.streams.started.fd, launched.gate_fd,
               launched.streams.channel.fd if launched.streams.channel else None):  # fmt: skip
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    launched.gate_fd = None
    for pipe in (launched.proc.stdin, launched.proc.stdout, launched.proc.stderr):
        if pipe is not None:
            pipe.close()


def discard(launched: Launched) -> None:
    """Kill and reap an execution that will never be finished (a warm slot not used)."""
    launched.kill()
    with contextlib.suppress(ProcessLookupError):
        os.kill(launched.proc.pid, signal.SIGKILL)
    close(launched)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(launched.proc.pid, 0)
