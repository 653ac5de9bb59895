"""Warm slots (moerl.sandbox.warm): executions launched ahead of time keep every
isolation property of a launch on demand. A slot is used once; its program starts
when it is taken (or, `starts_on_stdin`, waits for a stdin that exists only then);
the wall-clock limit counts from the take; a slot that died while idle is not used;
closing leaves no process, cgroup or work dir behind."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moerl.sandbox import ExecutionStatus, Limits, Sandbox
from moerl.sandbox.warm import WarmPool

pytestmark = pytest.mark.sandbox
PY = "/usr/bin/python3"


@pytest.fixture
def warm(sandbox: Sandbox) -> Iterator[Sandbox]:
    box = Sandbox(dataclasses.replace(sandbox.config, warm_slots=2))
    yield box
    box.close()


def _pool(box: Sandbox) -> WarmPool:
    assert box.warm_pool is not None
    return box.warm_pool


def _filled(box: Sandbox, argv: list[str], **kwargs: object) -> None:
    """Send one request of this signature (it fills the pool), then wait for every slot."""
    box.run_fresh(argv, **kwargs)  # type: ignore[arg-type]
    deadline = time.monotonic() + 30
    while _pool(box).idle_count() < box.config.warm_slots:
        assert time.monotonic() < deadline, "the pool did not fill"
        time.sleep(0.02)


def test_gated_program_starts_when_taken(warm: Sandbox) -> None:
    argv = [PY, "-I", "-S", "-c", "import time; print(time.time())"]
    _filled(warm, argv)
    time.sleep(0.5)
    taken_at = time.time()
    result = warm.run_fresh(argv)
    assert result.status is ExecutionStatus.OK, result
    assert float(result.text()) >= taken_at
    assert _pool(warm).taken >= 1


def test_program_on_stdin_gets_only_its_own_input(warm: Sandbox) -> None:
    argv = [PY, "-I", "-S", "-c", "import sys; print(sys.stdin.read()[::-1])"]
    _filled(warm, argv, stdin=b"first", starts_on_stdin=True)
    outputs = [warm.run_fresh(argv, stdin=f"item{i}".encode(), starts_on_stdin=True).text()
               for i in range(4)]  # fmt: skip
    assert outputs == [f"{i}meti\n" for i in range(4)]
    assert _pool(warm).taken >= 1


def test_slots_never_share_files(warm: Sandbox) -> None:
    """Each run finds /work and /tmp empty, whatever the run before it left there."""
    argv = [PY, "-I", "-S", "-c",
            "import os; print(sorted(os.listdir('/work')), sorted(os.listdir('/tmp')));"
            "open('/work/left', 'w').write('x'); open('/tmp/left', 'w').write('x')"]  # fmt: skip
    _filled(warm, argv)
    for _ in range(4):
        result = warm.run_fresh(argv)
        assert result.status is ExecutionStatus.OK and result.text() == "[] []\n", result
    assert _pool(warm).taken >= 1


def test_wall_clock_counts_from_the_take(warm: Sandbox) -> None:
    limits = Limits(wall_time_s=1.0)
    argv = [PY, "-I", "-S", "-c", "import time; time.sleep(0.6)"]
    _filled(warm, argv, limits=limits)
    time.sleep(1.2)  # idle longer than the limit
    result = warm.run_fresh(argv, limits=limits)
    assert result.status is ExecutionStatus.OK, result
    slow = warm.run_fresh([PY, "-I", "-S", "-c", "import time; time.sleep(5)"], limits=limits)
    assert slow.status is ExecutionStatus.TIMEOUT and slow.wall_time_s < 3, slow


def test_a_slot_that_died_idle_is_not_used(warm: Sandbox) -> None:
    argv = [PY, "-I", "-S", "-c", "print('ran')"]
    _filled(warm, argv)
    pool = _pool(warm)
    with pool._lock:  # kill every idle slot's bwrap, as the OOM killer might
        pids = [slot.launched.proc.pid for q in pool._idle.values() for slot in q]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    taken = pool.taken
    result = warm.run_fresh(argv)
    assert result.status is ExecutionStatus.OK and result.text() == "ran\n", result
    assert pool.taken == taken  # served by a launch of its own


def test_close_leaves_nothing(sandbox: Sandbox) -> None:
    box = Sandbox(dataclasses.replace(sandbox.config, warm_slots=3))
    _filled(box, [PY, "-I", "-S", "-c", "import sys; sys.stdin.read()"], starts_on_stdin=True)
    pool = _pool(box)
    with pool._lock:
        slots = [slot for q in pool._idle.values() for slot in q]
    pids = [slot.launched.proc.pid for slot in slots]
    groups = [d for slot in slots if slot.launched.group for d in slot.launched.group.dirs.values()]
    work_dirs = [slot.workspace.path for slot in slots]
    assert len(pids) == 3 and all(Path(f"/proc/{pid}").exists() for pid in pids)
    assert groups and all(d.exists() for d in groups + work_dirs)
    box.close()
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert not any(d.exists() for d in groups + work_dirs)
