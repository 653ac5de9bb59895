"""`moerl eval agent --check DIR`: a directory of a user's terminal tasks, checked
before they are trained on.

Each task file is loaded on its own (a bad file is a row, not the end of the run);
each task's `solution` is replayed in the real sandbox and must score 1, its `wrong`
sequence (when it has one) must score 0. What went wrong is shown where it happened:
the file that does not load (and the field), the setup script's own error output, an
action the sandbox could not run, and an exception raised by the check (a NameError
shows as that, not as a score of 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from moerl.agent.environment import AgentTask
from moerl.agent.suite import SuiteError, SuiteTask, load_task_file, task_files
from moerl.agent.terminal import TerminalEnvironment
from moerl.agent.tools import ToolCall
from moerl.sandbox import Sandbox


@dataclass(frozen=True)
class Replay:
    """One action sequence of a task, replayed and verified."""

    setup_error: str | None = None
    reward: float | None = None
    problems: tuple[str, ...] = ()


@dataclass
class CheckRow:
    """One task file's verdict."""

    file: str
    task_id: str = "-"
    load_error: str | None = None
    solution: Replay | None = None
    wrong: Replay | None = None
    """None when the file gives no `wrong` sequence."""
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Loads, sets up, the solution scores 1 and the wrong sequence 0, and nothing
        faulted or raised on the way."""
        if self.load_error is not None or self.solution is None or self.notes:
            return False
        runs = [(self.solution, 1.0)] + ([(self.wrong, 0.0)] if self.wrong else [])
        return all(r.setup_error is None and r.reward == want and not r.problems
                   for r, want in runs)


def replay(sandbox: Sandbox, task: AgentTask, actions: Sequence[ToolCall]) -> Replay:
    """Reset `task` in a fresh work dir, run `actions`, verify."""
    env = TerminalEnvironment(sandbox)
    try:
        first = env.reset(task)
        if first.fault is not None:
            return Replay(setup_error=first.fault)
        problems = []
        for i, call in enumerate(actions):
            obs = env.step(call)
            if obs.fault is not None:
                problems.append(f"action {i + 1} ({call.name}): {obs.fault}")
            if obs.done:
                break
        verdict = env.verify()
        if verdict.infra_error is not None:
            problems.append(f"verifier: {verdict.infra_error}")
        if verdict.details.get("check_error"):
            problems.append(f"check() raised {verdict.details['check_error']}")
        elif verdict.details.get("error"):
            problems.append(f"check: {verdict.details['error']}")
        return Replay(reward=verdict.reward, problems=tuple(problems))
    finally:
        env.close()


def check_dir(directory: Path, sandbox: Sandbox) -> list[CheckRow]:
    """Every task file of `directory`, loaded and replayed both ways."""
    rows: list[CheckRow] = []
    seen: dict[str, str] = {}
    for path in task_files(directory):
        row = CheckRow(path.name)
        rows.append(row)
        try:
            task: SuiteTask = load_task_file(path, path.name)
        except SuiteError as err:
            row.load_error = str(err)
            continue
        row.task_id = task.id
        if task.id in seen:
            row.notes.append(f"id {task.id!r} also in {seen[task.id]}")
        seen.setdefault(task.id, path.name)
        row.solution = replay(sandbox, task.task, task.solution)
        if task.wrong:
            row.wrong = replay(sandbox, task.task, task.wrong)
    return rows


def _cell(run: Replay | None, want: float) -> str:
    if run is None:
        return "-"
    if run.setup_error is not None:
        return "setup failed"
    score = "none" if run.reward is None else f"{run.reward:.2f}"
    return score if run.reward == want else f"{score} (want {want:.0f})"


def check_table(rows: Sequence[CheckRow], directory: Path) -> Table:
    table = Table(title=f"task check: {directory}")
    for name in ("file", "task", "loads", "setup", "solution", "wrong", "what went wrong"):
        table.add_column(name, overflow="fold")
    for row in rows:
        runs = [r for r in (row.solution, row.wrong) if r is not None]
        setup = next((r.setup_error for r in runs if r.setup_error), None)
        problems = [*row.notes, *(p for r in runs for p in r.problems)]
        if row.load_error:
            problems.insert(0, row.load_error)
        if setup:
            problems.insert(0, setup)
        table.add_row(row.file, row.task_id, "no" if row.load_error else "yes",
                      "-" if row.load_error else ("failed" if setup else "ok"),
                      _cell(row.solution, 1.0), _cell(row.wrong, 0.0),
                      "\n".join(dict.fromkeys(problems)), style="green" if row.passed else "red")
    return table
