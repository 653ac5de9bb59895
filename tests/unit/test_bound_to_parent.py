"""Processes bound to their parent's life: the exec wrapper the local launcher starts
stages through, and the checkpoint writer's helper of a trainer that is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from moerl.launchers.proctree import descendants, kill_pids, still_running

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC}


def _gone(snapshot: dict[int, str], timeout: float = 15.0) -> list[int]:
    """The processes of `snapshot` still running after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := still_running(snapshot)) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_pids(left)  # nothing outlives the test, whatever it found
    return left


def _start_and_kill(script: str) -> tuple[dict[int, str], list[int]]:
    """Run `script` (it prints one line once its children are up), SIGKILL it, and
    return its descendants from before the kill with those that survived it."""
    parent = subprocess.Popen([PY, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE,
                              env=ENV, text=True)  # fmt: skip
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line, "the parent exited before starting its children"
    snapshot = descendants(parent.pid)
    parent.kill()
    parent.wait()
    return snapshot, _gone(snapshot)


def test_wrapped_command_dies_with_its_parent() -> None:
    snapshot, left = _start_and_kill("""
        import subprocess, time
        from moerl.parent_death import wrapped
        child = subprocess.Popen(wrapped(["sleep", "300"]), start_new_session=True)
        while "sleep" not in open(f"/proc/{child.pid}/cmdline").read():
            time.sleep(0.05)  # exec'd: the wrapper has set the signal
        print("up", flush=True)
        time.sleep(300)
    """)
    assert len(snapshot) == 1 and left == []


def test_a_parent_already_gone_is_seen() -> None:
    """The check after prctl: a process whose parent is not the one named signals itself."""
    child = subprocess.run([PY, "-m", "moerl.parent_death", "1", str(int(signal.SIGTERM)),
                            "--", "sleep", "30"], env=ENV, timeout=60)  # fmt: skip
    assert child.returncode == -signal.SIGTERM


def test_checkpoint_writer_helper_dies_with_a_killed_trainer() -> None:
    """megatron-core's results-queue Manager and multiprocessing's resource tracker,
    started as a trainer starts them, do not outlive a SIGKILL of the trainer."""
    snapshot, left = _start_and_kill("""
        import signal, time
        if __name__ == "__main__":
            from megatron.core.dist_checkpointing.strategies import filesystem_async
            from moerl import signals
            signals.start_helpers_ignoring((signal.SIGUSR1,))
            queue = filesystem_async.get_write_results_queue()
            assert queue is filesystem_async._results_queue
            queue.put("written")
            assert queue.get() == "written"
            signals.start_helpers_ignoring((signal.SIGUSR1,))  # idempotent: one helper
            print(signals._helper_manager._process.pid, flush=True)
            time.sleep(300)
    """)
    assert len(snapshot) == 2, snapshot  # the Manager and the resource tracker
    assert left == [], f"outlived the trainer: {left}"
