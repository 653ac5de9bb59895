"""The suite leaves no process behind (a pytest plugin, loaded by tests/conftest.py).

The pytest process that owns the run (the xdist controller, or a plain pytest) puts a
marker in its environment at start-up, so every process the run starts inherits it:
xdist workers, servers, launchers, torchrun ranks and what they fork. When the run
ends, every process still carrying the marker is a leftover: the run waits a grace
period for processes that are still exiting (workers, their fork servers), then
names each survivor, kills it and fails the run.

A process started with an environment of its own (a sandbox's `--clearenv`, a test's
`env={...}` without `os.environ`) carries no marker; the sandbox tests find their
leftovers by cgroup instead.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from contextlib import suppress
from pathlib import Path

import pytest

MARKER = "MOERL_TEST_SESSION"
GRACE_S = 30.0
_owner_key = pytest.StashKey[str]()


def marked_processes(value: str) -> dict[int, str]:
    """pid -> command line of every process (not zombie) whose environment holds
    MARKER=value, this process excluded."""
    needle = f"{MARKER}={value}".encode() + b"\0"
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with suppress(OSError):
            if needle not in (entry / "environ").read_bytes() + b"\0":
                continue
            stat = (entry / "stat").read_text()
            if stat[stat.rfind(")") + 2 :].startswith("Z"):
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found[int(entry.name)] = cmdline.strip()[:200]
    return found


def own_helpers() -> set[int]:
    """This process's multiprocessing fork server and resource tracker: they read a
    pipe from this process and end when it does, after the check."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    pids = {getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
            getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)}
    return {pid for pid in pids if pid is not None}


def survivors(value: str, grace_s: float) -> dict[int, str]:
    """The marked processes still running after up to `grace_s` seconds, this
    process's own multiprocessing helpers aside."""
    deadline = time.monotonic() + grace_s
    own = own_helpers()
    while True:
        left = {pid: cmd for pid, cmd in marked_processes(value).items() if pid not in own}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def pytest_configure(config: pytest.Config) -> None:
    if MARKER in os.environ:  # an xdist worker, or a pytest started by a test
        return
    value = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.environ[MARKER] = value
    config.stash[_owner_key] = value


@pytest.hookimpl(trylast=True)  # after xdist has shut its workers down
def pytest_sessionfinish(session: pytest.Session) -> None:
    value = session.config.stash.get(_owner_key, None)
    if value is None or not Path("/proc").is_dir():
        return
    left = survivors(value, float(os.environ.get("MOERL_LEFTOVER_GRACE_S", GRACE_S)))
    if not left:
        return
    for pid in left:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(left)} process(es) started by this test run outlived it (now killed):"]
    lines += [f"  pid {pid}: {cmd}" for pid, cmd in sorted(left.items())]
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "leftover processes", red=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print("\n".join(lines))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
