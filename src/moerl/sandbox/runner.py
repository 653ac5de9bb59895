"""Run one program in the sandbox and say exactly what happened.

Thread-safe: a reward server calls `Sandbox.run` from many threads at once. Each call
has its own cgroup, work dir and pipes; fds are handed to the child only through
`pass_fds`, so one run never inherits another's pipes. Note that `--die-with-parent`
is tied to the *thread* that started bwrap: `run` blocks in that thread until the end,
and warm slots (warm.py) are launched by the pool's own long-lived thread.

A result is returned once every process of the program is dead: its pipes are at EOF
and, with cgroups, the execution's group counts no task but bwrap's own two (pid 1 may
still be unmounting the namespaces); a process of the program left behind is killed
first. Without cgroups, pid 1 itself must have exited. Reaping bwrap and removing the
group and the work dir happen afterwards in the background (cleanup.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from moerl.sandbox.cgroups import Cgroup, CgroupLayout, CgroupUnavailable, detect, sweep_stale
from moerl.sandbox.cleanup import Cleaner
from moerl.sandbox.config import WEAKER_MODE_NOTICE, Limits, SandboxConfig
from moerl.sandbox.launch import Launched, close, finish, launch, new_group
from moerl.sandbox.result import ExecutionResult, sandbox_error
from moerl.sandbox.seccomp import SeccompUnsupported, build_filter
from moerl.sandbox.warm import LaunchSignature, Slot, WarmPool
from moerl.sandbox.workroot import WorkRootUnusable, place_work_root
from moerl.sandbox.workspace import Workspace, readable_copy, sweep_stale_workspaces

log = logging.getLogger(__name__)
_BWRAP_EXIT_S = 1.0
"""How long bwrap may take to exit after the program (pid 1 unmounts) before it is killed."""


class SandboxUnavailable(RuntimeError):
    """Untrusted code cannot be run safely here; the message says what is missing."""


class Sandbox:
    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._runs = itertools.count()
        self._cleaner = Cleaner()
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
        try:
            work_root = place_work_root(self.config.work_root, self.config.sandbox_uid,
                                        self.config.sandbox_gid)  # fmt: skip
        except WorkRootUnusable as exc:
            raise SandboxUnavailable(str(exc)) from exc
        self.config = dataclasses.replace(self.config, work_root=work_root)
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
        self._warm = (WarmPool(self._launch_slot, self.config.warm_slots)
                      if self.config.warm_slots > 0 else None)  # fmt: skip

    def workspace(self) -> Workspace:
        return Workspace(self.config.work_root, (self.config.sandbox_uid, self.config.sandbox_gid))

    def clamp(self, limits: Limits | None) -> Limits:
        return _clamped(limits or self.config.default_limits, self.config.max_limits)

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
        try:
            binds = self._binds(extra_ro_binds)
        except OSError as exc:
            return sandbox_error(f"cannot bind {exc.filename} into the sandbox: {exc.strerror}")
        launched = self._launch(argv, workspace, lim, channel, binds, gated=False)
        if isinstance(launched, ExecutionResult):
            return launched
        try:
            return finish(launched, stdin)
        finally:
            self._end(launched, None, None)

    def run_fresh(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes = b"",
        limits: Limits | None = None,
        channel: bool = False,
        extra_ro_binds: Sequence[tuple[Path, str]] = (),
        starts_on_stdin: bool = False,
    ) -> ExecutionResult:
        """`run` in a fresh, empty work dir, from a warm slot when the pool has one
        (`SandboxConfig.warm_slots`). `starts_on_stdin`: the program does nothing before
        it reads its stdin, so a warm slot may start it ahead of the request."""
        try:
            signature = LaunchSignature(
                tuple(argv),
                self.clamp(limits),
                channel,
                tuple(self._binds(extra_ro_binds)),
                starts_on_stdin,
            )
        except OSError as exc:
            return sandbox_error(f"cannot bind {exc.filename} into the sandbox: {exc.strerror}")
        warm = self._warm
        slot = warm.take(signature) if warm is not None else None
        taken = slot is not None
        if slot is None:
            made = self._launch_slot(signature)
            if isinstance(made, ExecutionResult):
                return made
            slot = made
        released = functools.partial(warm.release, signature) if warm and taken else None
        try:
            return finish(slot.launched, stdin)
        finally:
            self._end(slot.launched, slot.workspace, released)

    @property
    def warm_pool(self) -> WarmPool | None:
        return self._warm

    def wait_cleanup(self) -> None:
        """Return once the groups and work dirs of every execution finished so far are
        removed (they are removed in the background after each result)."""
        self._cleaner.drain()

    def close(self) -> None:
        """Stop the warm pool (idle slots killed, their groups and work dirs removed) and
        finish every pending removal."""
        if self._warm is not None:
            self._warm.close()
            self._warm = None
        self._cleaner.close()

    def _binds(self, extra_ro_binds: Sequence[tuple[Path, str]]) -> list[tuple[Path, str]]:
        return [(readable_copy(host, self.config.work_root), inside)
                for host, inside in extra_ro_binds]  # fmt: skip

    def _launch_slot(self, signature: LaunchSignature) -> Slot | ExecutionResult:
        workspace = self.workspace()
        launched = self._launch(
            signature.argv,
            workspace,
            signature.limits,
            signature.channel,
            signature.binds,
            gated=not signature.starts_on_stdin,
        )
        if isinstance(launched, ExecutionResult):
            workspace.remove()
            return launched
        return Slot(launched, workspace)

    def _launch(
        self,
        argv: Sequence[str],
        workspace: Workspace,
        lim: Limits,
        channel: bool,
        binds: Sequence[tuple[Path, str]],
        *,
        gated: bool,
    ) -> Launched | ExecutionResult:
        try:
            group = new_group(self.layout, next(self._runs), lim)
        except OSError as exc:
            return sandbox_error(f"cannot create cgroup: {exc}")
        launched = launch(self.config, self._seccomp, argv, workspace, lim, group,
                          channel=channel, binds=binds, gated=gated)  # fmt: skip
        if isinstance(launched, ExecutionResult) and group is not None:
            group.remove()
        return launched

    def _end(
        self, launched: Launched, workspace: Workspace | None, then: Callable[[], None] | None
    ) -> None:
        """Make sure nothing of the program runs on (kill what does), then queue the rest
        of the teardown: closing the host's fds, reaping bwrap, removing its group and
        `workspace` (a work dir of its own, or None); `then` is called last."""
        group = launched.group
        if group is not None and not launched.program_gone and launched.program_left():
            _kill_all(group)  # a background child outlived the program
        self._cleaner.submit(functools.partial(_release, launched, workspace, then))


@functools.lru_cache(maxsize=256)
def _clamped(limits: Limits, maxima: Limits) -> Limits:
    """`Limits.clamped_to`, remembered: a request's first step, and after an idle gap the
    validation of two fresh `Limits` costs a sizeable part of a trivial run."""
    return limits.clamped_to(maxima)


def _kill_all(group: Cgroup) -> None:
    if not group.kill_all():
        log.error("sandbox cgroup %s did not empty", group.dirs)


def _release(
    launched: Launched, workspace: Workspace | None, then: Callable[[], None] | None
) -> None:
    """Background part of an execution's teardown: close the host's fds, wait for bwrap to
    leave the group (pid 1 is unmounting the namespaces; killed if it takes too long),
    reap it, remove the group and the work dir; `then` runs whatever happens."""
    try:
        close(launched)
        group = launched.group
        if group is not None and not group.wait_empty(_BWRAP_EXIT_S):
            _kill_all(group)
        launched.reap()
        if group is not None:
            group.remove()
        if workspace is not None:
            workspace.remove()
    finally:
        if then is not None:
            then()
