"""Run one program in the sandbox and say exactly what happened.

Thread-safe: a reward server calls `Sandbox.run` from many threads at once. Each call
has its own cgroup, work dir and pipes; fds are handed to the child only through
`pass_fds`, so one run never inherits another's pipes. Note that `--die-with-parent`
is tied to the *thread* that started bwrap: `run` blocks in that thread until the end.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from moerl.sandbox import capture
from moerl.sandbox.bwrap import (
    LAUNCH_ENV,
    bwrap_argv,
    drop_privileges_argv,
    launcher_argv,
    starter_argv,
)
from moerl.sandbox.cgroups import Cgroup, CgroupLayout, CgroupUnavailable, detect, sweep_stale
from moerl.sandbox.config import WEAKER_MODE_NOTICE, Limits, SandboxConfig
from moerl.sandbox.result import ExecutionResult, sandbox_error
from moerl.sandbox.seccomp import SeccompUnsupported, build_filter
from moerl.sandbox.verdict import classify
from moerl.sandbox.workspace import Workspace, readable_copy, sweep_stale_workspaces

log = logging.getLogger(__name__)
_CHANNEL_CAP = 8 << 20


class SandboxUnavailable(RuntimeError):
    """Untrusted code cannot be run safely here; the message says what is missing."""


class Sandbox:
    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._runs = itertools.count()
        bwrap = Path(self.config.bwrap_path)
        if not (bwrap.is_file() and os.access(bwrap, os.X_OK)):
            raise SandboxUnavailable(
                f"bubblewrap not found at {self.config.bwrap_path}; install it "
                "(`apt-get install bubblewrap`). Untrusted code is never run without it."
            )
        if os.geteuid() == 0 and not os.access(self.config.setpriv_path, os.X_OK):
            raise SandboxUnavailable(
                f"running as root needs setpriv ({self.config.setpriv_path}, util-linux) to "
                "drop to the sandbox uid; refusing to run untrusted code as host uid 0"
            )
        try:
            self._seccomp = build_filter()
        except SeccompUnsupported as exc:
            raise SandboxUnavailable(f"{exc}; refusing to run untrusted code") from exc
        self.layout: CgroupLayout | None = None
        sweep_stale_workspaces(self.config.work_root)
        if self.config.isolation == "strict":
            try:
                self.layout = detect(self.config.cgroup_name)
            except CgroupUnavailable as exc:
                raise SandboxUnavailable(
                    f"{exc}. Refusing to run untrusted code without cgroup limits; to accept "
                    f"less, set isolation='no-cgroups' explicitly. {WEAKER_MODE_NOTICE}"
                ) from exc
            sweep_stale(self.layout)
        else:
            log.warning("sandbox in weaker mode: %s", WEAKER_MODE_NOTICE)

    def workspace(self) -> Workspace:
        return Workspace(self.config.work_root, (self.config.sandbox_uid, self.config.sandbox_gid))

    def clamp(self, limits: Limits | None) -> Limits:
        return (limits or self.config.default_limits).clamped_to(self.config.max_limits)

    def run(
        self,
        argv: Sequence[str],
        workspace: Workspace,
        *,
        stdin: bytes = b"",
        limits: Limits | None = None,
        channel: bool = False,
        extra_ro_binds: Sequence[tuple[Path, str]] = (),
    ) -> ExecutionResult:
        """Run `argv` inside the sandbox with `workspace` as its writable /work. With
        `channel`, the program finds a write-only pipe at fd $MOERL_CHANNEL_FD whose bytes
        come back in `result.channel`."""
        lim = self.clamp(limits)
        group = None
        if self.layout is not None:
            group = Cgroup(self.layout, f"{os.getpid()}-{next(self._runs)}-{secrets.token_hex(4)}")
            try:
                group.create(lim.memory_mb << 20, lim.max_processes)
            except OSError as exc:
                group.remove()
                return sandbox_error(f"cannot create cgroup: {exc}")
        try:
            return self._run(argv, workspace, stdin, lim, channel, extra_ro_binds, group)
        finally:
            if group is not None:
                if not group.kill_all():
                    log.error("sandbox cgroup %s did not empty", group.dirs)
                group.remove()

    def _run(
        self,
        argv: Sequence[str],
        workspace: Workspace,
        stdin: bytes,
        lim: Limits,
        channel: bool,
        extra_ro_binds: Sequence[tuple[Path, str]],
        group: Cgroup | None,
    ) -> ExecutionResult:
        try:
            binds = [(readable_copy(host, self.config.work_root), inside)
                     for host, inside in extra_ro_binds]  # fmt: skip
        except OSError as exc:
            return sandbox_error(f"cannot bind {exc.filename} into the sandbox: {exc.strerror}")
        seccomp_fd = os.memfd_create("moerl-seccomp")
        os.write(seccomp_fd, self._seccomp)
        os.lseek(seccomp_fd, 0, os.SEEK_SET)
        started_r, started_w = os.pipe()
        chan_r, chan_w = os.pipe() if channel else (None, None)
        command = bwrap_argv(
            self.config, workspace.path, starter_argv(started_w, chan_w, argv),
            seccomp_fd=seccomp_fd,
            extra_ro_binds=binds,
        )  # fmt: skip
        procs = group.procs_files() if group is not None else []
        passed = tuple(fd for fd in (seccomp_fd, started_w, chan_w) if fd is not None)
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                launcher_argv(procs, lim, [*drop_privileges_argv(self.config), *command]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=passed,
                env=dict(LAUNCH_ENV), close_fds=True, cwd="/",
            )  # fmt: skip
        except OSError as exc:
            for fd in (*passed, started_r, chan_r):
                if fd is not None:
                    os.close(fd)
            return sandbox_error(f"cannot start bubblewrap: {exc}")
        for fd in passed:
            os.close(fd)
        assert proc.stdout is not None and proc.stderr is not None and proc.stdin is not None
        pid_fd = os.pidfd_open(proc.pid)
        streams = capture.new_capture(
            proc.stdout.fileno(), proc.stderr.fileno(), started_r, chan_r,
            lim.max_output_bytes, _CHANNEL_CAP,
        )  # fmt: skip

        def kill() -> None:
            if group is not None:
                group.kill_all()
            else:  # bwrap is pid 1 of the namespace: its death takes every process with it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)

        try:
            stdin_fd = os.dup(proc.stdin.fileno())
            proc.stdin.close()
            capture.collect(
                pid_fd=pid_fd, stdin_fd=stdin_fd, stdin_data=stdin, streams=streams,
                deadline=start + lim.wall_time_s, kill=kill,
            )  # fmt: skip
            kill_if_alive(proc.pid, kill)
            # wait4 rather than Popen.wait: it also returns the tree's rusage.
            _, wait_status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(wait_status)
            wall = time.monotonic() - start
        finally:
            os.close(pid_fd)
            for fd in (started_r, chan_r):
                if fd is not None:
                    os.close(fd)
            proc.stdout.close()
            proc.stderr.close()
        stats = group.stats() if group is not None else None
        return classify(streams, wait_status, usage, wall, lim, stats)


def kill_if_alive(pid: int, kill: Callable[[], None]) -> None:
    """If collection ended without an exit (a stuck teardown), kill again before the
    blocking wait."""
    if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
