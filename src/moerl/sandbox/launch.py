"""One execution in two halves: `launch` starts bubblewrap in the execution's cgroup
with its pipes, `finish` feeds stdin and collects until the program's exit (the
caller makes sure nothing of it is left, and tears the rest down: runner.py).

`Sandbox.run` calls both at once. A warm slot (warm.py) is a launch done ahead of
time: bwrap and its namespaces are set up and the starter inside waits on a gate
pipe for the go byte before it execs the program (or, for a program that reads
nothing but its stdin before it acts, the program is already running and waiting
for that stdin). Either way no input of the execution exists before `finish`, and
the wall-clock limit counts from `finish`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
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
    GATE_BYTES,
    LAUNCH_ENV,
    StarterFds,
    bwrap_argv,
    drop_privileges_argv,
    launcher_argv,
    starter_argv,
)
from moerl.sandbox.cgroups import Cgroup, CgroupLayout, CgroupStats
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
    stats: CgroupStats | None = None
    """The group's counters, once read (`settle`)."""
    program_gone: bool = False
    """Every process of the program is known to be past its exit (`settle`)."""

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

    def bwrap_pids(self) -> set[int]:
        """bubblewrap's own processes in the execution's group: the monitor outside the
        namespaces (until it is reaped: then its pid may be anyone's) and pid 1 inside,
        from the status pipe only bwrap writes to. Neither runs the program's code, and
        pid 1's pid cannot go to a program process: when it dies, the namespace does."""
        pids = {self.proc.pid} if self.proc.returncode is None else set()
        init = self.streams.reported("child-pid")
        return pids if init is None else pids | {init}

    def program_left(self) -> bool:
        """Whether any task of the program is still in the group, alive or not yet reaped.
        The group's task count holds bwrap's own two at most (pid 1 is reaped only after
        every task of its namespace): anything above them is the program's."""
        if self.group is None:
            return False
        tasks = self.group.tasks()
        return tasks is None or tasks > len(self.bwrap_pids())  # unreadable: assume so

    def settle(self) -> None:
        """If the group holds nothing of the program any more, say so and read its
        counters: they are final. Called as soon as the program's pipes are at EOF,
        while bwrap is still reporting the exit; once more after it, if need be."""
        if self.group is None or self.program_gone:
            return
        if not self.program_left():
            self.program_gone = True
            self.stats = self.group.stats()

    def reap(self) -> None:
        """Wait for bubblewrap itself to exit (it has reported the exit code already);
        nothing when it is reaped already (its pid may be another child's by now)."""
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(ChildProcessError):
            _, wait_status, _ = os.wait4(self.proc.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(wait_status)

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
        group.hold_counters()
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
    pipes = _Pipes.open(channel=channel, gated=gated)
    inside = StarterFds(pipes.started[1], pipes.stdout[1], pipes.stderr[1],
                        channel=pipes.channel[1], gate=pipes.gate[0])  # fmt: skip
    command = bwrap_argv(config, workspace.path, starter_argv(inside, argv), seccomp_fd=seccomp_fd,
                         status_fd=pipes.status[1], extra_ro_binds=binds)  # fmt: skip
    procs = group.procs_files() if group is not None else []
    passed = (seccomp_fd, *pipes.child_ends())
    try:
        proc = subprocess.Popen(
            launcher_argv(procs, lim, [*drop_privileges_argv(config), *command]),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=passed, env=dict(LAUNCH_ENV), close_fds=True, cwd="/",
        )  # fmt: skip
    except OSError as exc:
        _close_all((*passed, *pipes.host_ends()))
        return sandbox_error(f"cannot start bubblewrap: {exc}")
    _close_all(passed)
    assert proc.stderr is not None
    fds = capture.Fds(pipes.stdout[0], pipes.stderr[0], pipes.started[0], pipes.channel[0],
                      bwrap=proc.stderr.fileno(), status=pipes.status[0])  # fmt: skip
    streams = capture.new_capture(fds, lim.max_output_bytes, _CHANNEL_CAP,
                                  await_bwrap=group is None)  # fmt: skip
    return Launched(proc, os.pidfd_open(proc.pid), streams, lim, group, pipes.gate[1])


_NO_PIPE: tuple[None, None] = (None, None)


@dataclass(frozen=True)
class _Pipes:
    """(read end, write end) of each pipe of one execution."""

    stdout: tuple[int, int]
    stderr: tuple[int, int]
    started: tuple[int, int]
    status: tuple[int, int]
    channel: tuple[int, int] | tuple[None, None]
    gate: tuple[int, int] | tuple[None, None]

    @classmethod
    def open(cls, *, channel: bool, gated: bool) -> _Pipes:
        optional = (os.pipe() if channel else _NO_PIPE, os.pipe() if gated else _NO_PIPE)
        return cls(os.pipe(), os.pipe(), os.pipe(), os.pipe(), *optional)

    def child_ends(self) -> tuple[int, ...]:
        """The ends handed to bwrap: it writes to all but the gate, which it reads."""
        ends = (self.stdout[1], self.stderr[1], self.started[1], self.status[1],
                self.channel[1], self.gate[0])  # fmt: skip
        return tuple(fd for fd in ends if fd is not None)

    def host_ends(self) -> tuple[int, ...]:
        ends = (self.stdout[0], self.stderr[0], self.started[0], self.status[0],
                self.channel[0], self.gate[1])  # fmt: skip
        return tuple(fd for fd in ends if fd is not None)


def _close_all(fds: Sequence[int | None]) -> None:
    for fd in fds:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def finish(launched: Launched, stdin: bytes) -> ExecutionResult:
    """Open the gate, feed `stdin`, collect until exit or the wall-clock limit. bwrap is
    reaped here, or later (`Launched.reap`) when it reported the exit code and the group
    accounts for the tree's CPU and memory (its rusage then adds nothing). The caller
    closes the host's fds (`close`), whatever happens here."""
    proc, streams, lim = launched.proc, launched.streams, launched.limits
    assert proc.stdin is not None
    start = time.monotonic()
    stdin_fd = os.dup(proc.stdin.fileno()) if stdin else None
    proc.stdin.close()
    capture.collect(
        pid_fd=launched.pid_fd, stdin_fd=stdin_fd, stdin_data=stdin, streams=streams,
        deadline=start + lim.wall_time_s, kill=launched.kill,
        go=functools.partial(_open_gate, launched), on_quiet=launched.settle,
    )  # fmt: skip
    code = streams.reported("exit-code")
    group = launched.group
    if code is not None and group is not None and group.accounts_cpu:
        wait_status, usage = (code & 0xFF) << 8, None  # as if it had exited with it
    else:
        wait_status, usage = _reap_now(launched)
    wall = time.monotonic() - start
    launched.settle()
    stats = launched.stats
    if stats is None and launched.group is not None:  # a process of it is still there
        stats = launched.group.stats()
    return classify(streams, wait_status, usage, wall, lim, stats)


def _open_gate(launched: Launched) -> None:
    if launched.gate_fd is not None:
        with contextlib.suppress(BrokenPipeError):  # the starter died: collect says why
            os.write(launched.gate_fd, GATE_BYTES)
        os.close(launched.gate_fd)
        launched.gate_fd = None


def _reap_now(launched: Launched) -> tuple[int, resource.struct_rusage]:
    proc = launched.proc
    if not launched.exited():  # collection ended without an exit: a stuck teardown
        launched.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    # wait4 rather than Popen.wait: it also returns the tree's rusage.
    _, wait_status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(wait_status)
    return wait_status, usage


def close(launched: Launched) -> None:
    """Release the host side's fds (the process is reaped or about to be)."""
    streams = launched.streams
    _close_all([launched.pid_fd, launched.gate_fd, streams.stdout.fd, streams.stderr.fd,
                streams.started.fd, streams.status.fd,
                streams.channel.fd if streams.channel else None])  # fmt: skip
    launched.gate_fd = None
    for pipe in (launched.proc.stdin, launched.proc.stderr):
        if pipe is not None:
            pipe.close()


def discard(launched: Launched) -> None:
    """Kill and reap an execution that will never be finished (a warm slot not used)."""
    launched.kill()
    with contextlib.suppress(ProcessLookupError):
        os.kill(launched.proc.pid, signal.SIGKILL)
    close(launched)
    launched.reap()
