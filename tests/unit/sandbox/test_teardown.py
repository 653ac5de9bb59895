"""The end of an execution: the result comes back as soon as the program is done, with
every process of it dead (a background child is killed first and writes nothing after);
bubblewrap's reaping and the removal of the group and the work dir happen afterwards in
the background, and `wait_cleanup`/`close` return only once they are done."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from proc_scan import processes_with

from moerl.sandbox import ExecutionStatus, Sandbox, SandboxConfig
from moerl.sandbox.bwrap import GATE_BYTES, StarterFds, starter_argv
from moerl.sandbox.cgroups import Cgroup
from moerl.sandbox.cleanup import Cleaner

pytestmark = pytest.mark.sandbox
PY = "/usr/bin/python3"
# Leaves a grandchild that closes its stdio (so no pipe waits for it), starts a session of
# its own and appends the monotonic clock (the host's: there is no time namespace) to
# /work/beat without pause; the program itself exits once a first whole beat is written.
# The grandchild's command line ends with a marker put together at run time: bwrap's argv
# holds this text.
WRITER = """
import time
while True:
    with open('/work/beat', 'a') as beat:
        beat.write(f'{time.monotonic_ns()}\\n')
"""
LEAVE_A_WRITER = f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for fd in (0, 1, 2):
            os.close(fd)
        os.execv('{PY}', ['{PY}', '-c', {WRITER!r}, 'moerl-wri' + 'ter-' + sys.argv[1]])
    os._exit(0)
def beat_written():  # a whole line: the file exists from the writer's open, empty
    try:
        with open('/work/beat') as beat:
            return '\\n' in beat.read()
    except FileNotFoundError:
        return False
while not beat_written():
    time.sleep(0.001)
print('left a writer')
"""


@pytest.fixture
def own_dirs(sandbox: Sandbox) -> Iterator[SandboxConfig]:
    """A config whose cgroups and work dirs live in places of their own (the work root
    must be reachable by the sandbox uid, which pytest's tmp_path is not)."""
    name = f"moerl-sandbox-test-{uuid.uuid4().hex[:8]}"
    work_root = Path(tempfile.gettempdir()) / name
    config = dataclasses.replace(sandbox.config, cgroup_name=name, warm_slots=2,
                                 work_root=work_root)  # fmt: skip
    yield config
    assert sandbox.layout is not None
    for base in sandbox.layout.bases.values():
        (base.parent / name).rmdir()
    shutil.rmtree(work_root)


@pytest.mark.parametrize("attempt", range(5))  # the writer would outlive it only by ~1 ms
def test_a_background_writer_is_dead_before_the_result(sandbox: Sandbox, attempt: int) -> None:
    tag = uuid.uuid4().hex
    with sandbox.workspace() as ws:
        result = sandbox.run([PY, "-I", "-S", "-c", LEAVE_A_WRITER, tag], ws)
        returned_ns = time.monotonic_ns()
        alive = processes_with(f"moerl-writer-{tag}")
        beats = (ws.path / "beat").read_text().split("\n")[:-1]  # the last may be cut short
        assert result.status is ExecutionStatus.OK and result.text() == "left a writer\n", result
        assert alive == []
        assert beats and int(beats[-1]) < returned_ns  # nothing wrote after the result


def test_the_next_run_after_a_background_child_is_clean(sandbox: Sandbox) -> None:
    box = Sandbox(dataclasses.replace(sandbox.config, warm_slots=2))
    tag = uuid.uuid4().hex
    marker = f"moerl-left-{tag}"  # made by the shell: the slots' own argv do not hold it
    look = [PY, "-I", "-S", "-c", "import os; print(os.listdir('/work'), os.listdir('/tmp'))"]
    try:
        box.run_fresh(look)  # fills the pool
        nap = f"{PY} -c 'import time; time.sleep(100)'"
        leave = (
            f'm=moerl-left; setsid {nap} "$m-{tag}" >/dev/null 2>&1 & touch /work/mine /tmp/mine'
        )
        left = box.run_fresh(["/bin/sh", "-c", leave])
        assert left.status is ExecutionStatus.OK, left
        assert processes_with(marker) == []
        for _ in range(3):
            after = box.run_fresh(look)
            assert after.status is ExecutionStatus.OK and after.text() == "[] []\n", after
    finally:
        box.close()


def test_a_program_killed_by_a_signal_reports_it(sandbox: Sandbox) -> None:
    with sandbox.workspace() as ws:
        result = sandbox.run(["/bin/sh", "-c", "echo before; kill -SEGV $$"], ws)
    assert result.status is ExecutionStatus.RUNTIME_ERROR, result
    assert result.signal == signal.SIGSEGV and result.exit_code is None
    assert result.stdout == b"before\n"


def test_output_written_just_before_exit_is_complete(sandbox: Sandbox) -> None:
    program = "import sys; sys.stdout.write('x' * 300000); sys.stderr.write('done')"
    with sandbox.workspace() as ws:
        result = sandbox.run([PY, "-I", "-S", "-c", program], ws)
    assert result.status is ExecutionStatus.OK, result
    assert result.stdout == b"x" * 300000 and result.stderr == b"done"


def test_wait_cleanup_and_close_leave_no_group_work_dir_or_bwrap(
    sandbox: Sandbox, own_dirs: SandboxConfig
) -> None:
    box = Sandbox(own_dirs)
    assert own_dirs.work_root is not None
    assert box.layout is not None
    bases = list(box.layout.bases.values())
    for _ in range(4):
        assert box.run_fresh(["/bin/true"]).status is ExecutionStatus.OK
        with box.workspace() as ws:
            assert box.run(["/bin/true"], ws).status is ExecutionStatus.OK
    box.wait_cleanup()
    runs_left = {p.name for base in bases for p in base.iterdir() if p.is_dir()}
    assert len(runs_left) <= 2  # the warm pool's idle slots, nothing else
    box.run_fresh(["/bin/true"])
    box.close()
    assert [p for base in bases for p in base.iterdir() if p.is_dir()] == []
    assert list(own_dirs.work_root.iterdir()) == []
    sandbox.wait_cleanup()  # the session's sandbox may still reap earlier runs
    assert _zombie_children() == []


def _zombie_children() -> list[int]:
    zombies = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z" and int(fields[1]) == os.getpid():
                zombies.append(int(entry.name))
    return zombies


def test_cleaner_runs_jobs_in_order_and_drains_on_close() -> None:
    cleaner = Cleaner()
    done: list[int] = []

    def slow(i: int) -> None:
        time.sleep(0.02)
        done.append(i)

    for i in range(3):
        cleaner.submit(lambda i=i: slow(i))
    cleaner.drain()
    assert done == [0, 1, 2]
    cleaner.submit(lambda: slow(3))
    cleaner.close()
    assert done == [0, 1, 2, 3]
    cleaner.submit(lambda: done.append(4))  # closed: runs at once, in the caller
    assert done == [0, 1, 2, 3, 4]


def test_a_failing_cleanup_job_does_not_stop_the_others() -> None:
    cleaner = Cleaner()
    done: list[str] = []

    def fail() -> None:
        raise OSError("simulated")

    cleaner.submit(fail)
    cleaner.submit(lambda: done.append("after"))
    cleaner.close()
    assert done == ["after"]


def _run_starter(fds: StarterFds, gate: bytes, argv: list[str]) -> tuple[bytes, bytes, bytes]:
    """Run the starter script outside any sandbox, with its pipes at exactly the fd
    numbers of `fds` (a helper moves them there), and return (started, stdout, stderr)."""
    pipes = {name: os.pipe() for name in ("started", "stdout", "stderr", "channel", "gate")}
    inside = {name: getattr(fds, name) for name in pipes}
    child_ends = {name: (r if name == "gate" else w) for name, (r, w) in pipes.items()}
    moves = ",".join(f"({child_ends[n]},{inside[n]})" for n in pipes)
    # Staged above 100 first, so that no move lands on a pipe that has yet to move.
    helper = (f"import fcntl,os,sys\nmoves=[{moves}]\n"
              "staged=[(fcntl.fcntl(a,fcntl.F_DUPFD,100),b) for a,b in moves]\n"
              "[os.close(a) for a,_ in moves]\n[os.dup2(a,b) for a,b in staged]\n"
              "[os.close(a) for a,_ in staged]\nos.execv(sys.argv[1],sys.argv[1:])")  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", helper, *starter_argv(fds, argv)], pass_fds=child_ends.values()
    )
    for end in child_ends.values():
        os.close(end)
    os.write(pipes["gate"][1], gate)
    os.close(pipes["gate"][1])
    assert proc.wait(timeout=30) is not None
    read = {n: os.read(pipes[n][0], 4096) for n in ("started", "stdout", "stderr")}
    for name in ("started", "stdout", "stderr", "channel"):
        os.close(pipes[name][0])
    return read["started"], read["stdout"], read["stderr"]


@pytest.mark.parametrize("numbers", [(3, 4, 5, 6, 7), (9, 8, 7, 6, 5), (40, 41, 42, 43, 44)])
def test_the_warm_starter_waits_for_the_gate_whatever_its_fd_numbers(
    numbers: tuple[int, int, int, int, int],
) -> None:
    """The waiter (dash) can name fds 3-9 only; the starter moves the gate and the
    started pipe to free ones, so low numbers of its own pipes are not clobbered."""
    fds = StarterFds(*numbers[:3], channel=numbers[3], gate=numbers[4])
    show = 'echo out; echo err >&2; echo "$MOERL_CHANNEL_FD"; ls /proc/self/fd | sort -n'
    started, out, err = _run_starter(fds, GATE_BYTES, ["/bin/sh", "-c", show])
    assert started == b"S" and err == b"err\n"
    lines = out.decode().split()
    assert lines[:2] == ["out", str(fds.channel)]
    assert sorted(int(fd) for fd in lines[2:]) == sorted({0, 1, 2, fds.channel, 3})  # 3: ls's dir
    started, out, err = _run_starter(fds, b"", ["/bin/sh", "-c", "echo ran"])
    assert started == b"S" and out == b""  # the gate closed without its bytes: nothing runs


def test_an_unreadable_task_count_means_kill_before_the_result(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the count, nothing proves the program gone: the group is killed first."""
    killed: list[Cgroup] = []
    kill_all = Cgroup.kill_all

    def spy(group: Cgroup, timeout_s: float = 5.0) -> bool:
        killed.append(group)
        return kill_all(group, timeout_s)

    monkeypatch.setattr(Cgroup, "tasks", lambda group: None)
    monkeypatch.setattr(Cgroup, "kill_all", spy)
    with sandbox.workspace() as ws:
        result = sandbox.run(["/bin/sh", "-c", "echo fine"], ws)
    assert result.status is ExecutionStatus.OK and result.text() == "fine\n", result
    assert len(killed) == 1
    assert result.cpu_time_s > 0 and result.peak_memory_bytes  # counters read regardless
