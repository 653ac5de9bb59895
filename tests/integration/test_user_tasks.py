"""A user's own terminal tasks, in the shipped format, from a directory: checked by
`moerl eval agent --check DIR` (every problem shown where it happened), evaluated with
`--tasks-dir`, and shown to the model with the files their setup made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moerl.agent.suite import select_tasks
from moerl.agent.terminal import TerminalEnvironment
from moerl.sandbox import Sandbox, SandboxConfig

pytestmark = pytest.mark.sandbox
MINE = Path(__file__).with_name("user_tasks")
GOOD = (MINE / "kitchen-copy.yaml").read_text()


def _eval(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    return subprocess.run([sys.executable, "-m", "moerl.launchers.cli", "eval", "agent", *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "250"})  # fmt: skip


def _variant(directory: Path, name: str, old: str, new: str) -> None:
    text = GOOD.replace("id: kitchen-copy", f"id: {name}").replace(old, new)
    assert text != GOOD.replace("id: kitchen-copy", f"id: {name}"), (name, old)
    (directory / f"{name}.yaml").write_text(text)


def test_check_shows_each_problem_where_it_happened(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    shutil.copy(MINE / "kitchen-copy.yaml", mine)
    _variant(mine, "name-error", 'return read("out.txt")', 'return reed("out.txt")')
    _variant(mine, "bad-setup", "mkdir -p notes", "echo 'no such oven' >&2; false; mkdir -p notes")
    _variant(mine, "lenient", 'return read("out.txt") == "boil water\\n"', "return True")
    _variant(mine, "no-check", "check: |", "chekc: |")
    done = _eval("--check", str(mine))
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    rows = {line.split("│")[1].strip(): line for line in out.splitlines()
            if line.count("│") > 6 and ".yaml" in line}
    assert set(rows) == {"kitchen-copy.yaml", "name-error.yaml", "bad-setup.yaml",
                         "lenient.yaml", "no-check.yaml"}, out
    assert "NameError" in out and "reed" in out  # the check's exception, not just a 0
    assert "no such oven" in out  # the setup's own error output
    assert "1.00 (want 0)" in rows["lenient.yaml"]  # accepts the wrong sequence
    assert "unknown field 'chekc'" in out
    assert "1/5 task files pass" in out
    shutil.rmtree(mine)
    mine.mkdir()
    shutil.copy(MINE / "kitchen-copy.yaml", mine)
    done = _eval("--check", str(mine))
    assert done.returncode == 0 and "1/1 task files pass" in done.stdout, done.stdout


def test_tasks_dir_adds_them_to_an_evaluation(tmp_path: Path) -> None:
    mine = shutil.copytree(MINE, tmp_path / "mine")
    done = _eval("--policy", "scripted", "--tasks-dir", str(mine), "--category", "kitchen",
                 "--out", str(tmp_path / "agent.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kitchen-copy" in done.stdout and "completion rate 1.000 (1/1" in done.stdout


def test_the_first_observation_lists_what_the_setup_made() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    (task,) = select_tasks(["kitchen-copy"], dirs=[MINE])
    env = TerminalEnvironment(Sandbox(SandboxConfig()))
    try:
        first = env.reset(task.task)
    finally:
        env.close()
    assert first.fault is None
    assert first.text.splitlines() == ["Files in /work:", "made.txt", "notes/a.txt",
                                       "recipe.txt"]
