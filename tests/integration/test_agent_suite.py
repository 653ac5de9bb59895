"""Every shipped terminal task against its verifier, in the real sandbox.

`moerl eval agent --policy scripted` runs end to end (a subprocess, the whole suite) and
every task's scripted solution scores 1.0; every task's plausible-but-wrong sequence
and the empty sequence (submit at once) score 0.0. All episodes run concurrently: two
scheduler runs in all, about half a minute on two cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest

from moerl.agent.environment import AgentTask
from moerl.agent.scheduler import AgentScheduler, SchedulerConfig
from moerl.agent.suite import SuiteTask, all_tasks
from moerl.agent.tasks import SUBMIT, ScriptedPolicy, tagged
from moerl.agent.terminal import TerminalEnvironment
from moerl.agent.tools import ToolCall, parse_tool_call
from moerl.agent.trajectory import Trajectory
from moerl.data.tokenizer import ByteTokenizer
from moerl.sandbox import Sandbox, SandboxConfig

pytestmark = pytest.mark.sandbox
TASKS = all_tasks()
IDS = [t.id for t in TASKS]
TOK = ByteTokenizer()


def _need(*tools: str) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (scripts/setup.sh installs it as root)")


@pytest.fixture(scope="module")
def eval_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _need("bwrap", "gcc", "make", "git")
    out = tmp_path_factory.mktemp("eval") / "agent.json"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "moerl.launchers.cli", "eval", "agent", "--policy", "scripted",
         "--concurrency", "6", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    print(f"moerl eval agent --policy scripted: {time.monotonic() - start:.1f}s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "completion rate 1.000" in proc.stdout
    report: dict[str, Any] = json.loads(out.read_text())
    return report


@pytest.fixture(scope="module")
def failing_runs() -> dict[str, Trajectory]:
    """Each task with its wrong sequence and with the empty one, all in one run."""
    _need("bwrap", "gcc", "make", "git")
    sandbox = Sandbox(SandboxConfig())
    variants: list[SuiteTask] = []
    scripts = {}
    for t in TASKS:
        for kind, actions in (("wrong", t.wrong), ("empty", (SUBMIT,))):
            task = tagged(dataclasses.replace(t.task, id=f"{t.id}@{kind}"))
            variants.append(SuiteTask(task, t.category, t.solution, t.wrong))
            scripts[task.id] = actions
    start = time.monotonic()
    trajs = AgentScheduler(ScriptedPolicy(scripts, TOK), lambda: TerminalEnvironment(sandbox),
                           TOK, SchedulerConfig(max_concurrency=6)).run([v.task for v in variants])
    print(f"{len(trajs)} wrong/empty episodes: {time.monotonic() - start:.1f}s")
    return {t.task_id: t for t in trajs}


def test_eval_report_covers_every_task(eval_report: dict[str, Any]) -> None:
    assert eval_report["policy"] == "scripted" and eval_report["tasks"] == len(TASKS)
    assert eval_report["completion_rate"] == 1.0 and eval_report["infra_failures"] == 0
    assert set(eval_report["categories"]) == {"files", "fix-test", "c", "logs", "git"}
    assert [r["task_id"] for r in eval_report["results"]] == IDS


@pytest.mark.parametrize("task_id", IDS)
def test_scripted_solution_solves(eval_report: dict[str, Any], task_id: str) -> None:
    (row,) = [r for r in eval_report["results"] if r["task_id"] == task_id]
    assert row["status"] == "submitted" and row["reward"] == 1.0, row


@pytest.mark.parametrize("task_id", IDS)
def test_wrong_and_empty_actions_fail(failing_runs: dict[str, Trajectory], task_id: str) -> None:
    for kind in ("wrong", "empty"):
        traj = failing_runs[f"{task_id}@{kind}"]
        assert traj.status == "submitted", (kind, traj.infra_error)
        assert traj.reward == 0.0, (kind, traj.verify_details)
        assert traj.env_faults == 0 and "check_error" not in traj.verify_details, kind


def test_a_partial_solution_is_no_pass() -> None:
    """The helper script written but never run: the check finds no output and says 0."""
    _need("bwrap")
    (task,) = [t for t in TASKS if t.id == "logs-level-summary"]
    sandbox = Sandbox(SandboxConfig())
    env = TerminalEnvironment(sandbox)
    try:
        env.reset(task.task)
        env.step(task.solution[1])  # summarize.py written, never run: no summary.json
        result = env.verify()
    finally:
        env.close()
    assert result.reward == 0.0 and result.infra_error is None


def test_a_call_with_lone_surrogates_runs_in_the_trainers_own_terminal() -> None:
    """environments.servers=0: the terminal runs in this process, so a tool call whose
    text the model's byte-level decode left with a lone surrogate must still be written."""
    _need("bwrap")
    sandbox = Sandbox(SandboxConfig())
    env = TerminalEnvironment(sandbox)
    text = ('<tool_call>{"name": "write_file", "arguments": {"path": "note.txt", '
            '"content": "a\\udc80b"}}</tool_call>')
    try:
        env.reset(AgentTask("surrogate", "write a note"))
        call = parse_tool_call(text, env.tools)
        assert isinstance(call, ToolCall)
        observation = env.step(call)
        assert not observation.error and observation.fault is None, observation
        assert env.work_dir is not None
        assert (env.work_dir / "note.txt").read_text() == "a\ufffdb"
    finally:
        env.close()
