"""The suite's no-leftover check (tests/leftover_processes.py) on a pytest run of its own:
a test that leaves a detached process fails the run, which names and kills it; a test
that cleans up passes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from leftover_processes import MARKER

TESTS = Path(__file__).resolve().parents[1]


def _run_pytest(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess[str], str]:
    tag = uuid.uuid4().hex
    (tmp_path / "test_inner.py").write_text(
        "import subprocess\nimport sys\n\n\ndef test_inner():\n" + body.replace("TAG", tag))
    env = {k: v for k, v in os.environ.items() if k != MARKER}  # the inner run owns its marker
    env |= {"PYTHONPATH": str(TESTS), "MOERL_LEFTOVER_GRACE_S": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "leftover_processes", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        env=env, capture_output=True, text=True, timeout=120)
    return done, tag


def _running(tag: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and tag.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def test_a_detached_leftover_fails_the_run_and_is_killed(tmp_path: Path) -> None:
    # The inner test records its marker and its child, and checks the child still runs.
    body = ("    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)',\n"
            "                              'TAG'], start_new_session=True)\n"
            "    import os, pathlib, time\n"
            "    time.sleep(0.2)\n"
            "    assert child.poll() is None\n"
            f"    pathlib.Path({str(tmp_path / 'seen')!r}).write_text(\n"
            f"        f'{{child.pid}} {{os.environ.get({MARKER!r})}}')\n")
    done, tag = _run_pytest(tmp_path, body)
    seen = (tmp_path / "seen").read_text() if (tmp_path / "seen").exists() else "nothing"
    assert done.returncode == 1, f"inner child and marker: {seen}\n{done.stdout}{done.stderr}"
    assert "1 passed" in done.stdout
    assert "leftover processes" in done.stdout and f"time.sleep(300) {tag}" in done.stdout
    deadline = time.monotonic() + 5
    while _running(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(tag) == []


def test_a_run_that_reaps_its_processes_passes(tmp_path: Path) -> None:
    done, _ = _run_pytest(tmp_path, "    subprocess.run(['true'], check=True)\n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "leftover processes" not in done.stdout
