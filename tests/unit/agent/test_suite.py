"""The shipped task suite as data: it loads, covers every category, and malformed task
files fail with the file and the field named; a user's directory of tasks adds to it
(no sandbox needed here)."""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from moerl.agent.suite import (
    CATEGORIES,
    SuiteError,
    all_tasks,
    parse_action,
    parse_task,
    select_tasks,
)
from moerl.agent.tools import ToolCall
from moerl.rl.config import AgentTasksConfig, RLConfig


def test_suite_has_at_least_30_tasks_over_every_category() -> None:
    tasks = all_tasks()
    counts = collections.Counter(t.category for t in tasks)
    assert len(tasks) >= 30
    assert set(counts) == set(CATEGORIES) and min(counts.values()) >= 5, counts
    assert len({t.id for t in tasks}) == len(tasks)
    for t in tasks:
        assert t.solution[-1] == ToolCall("submit", {}), t.id
        assert t.wrong != t.solution and "def check(" in t.task.check


def test_selection_by_glob_and_category() -> None:
    git = select_tasks(categories=["git"])
    assert git and all(t.category == "git" for t in git)
    assert [t.id for t in select_tasks(["c-fix-*"])] == ["c-fix-factorial", "c-fix-reverse",
                                                         "c-fix-syntax"]
    with pytest.raises(SuiteError, match="'c-nope' matches no task"):
        select_tasks(["c-nope"])
    with pytest.raises(SuiteError, match="unknown task category 'rust'"):
        select_tasks(categories=["rust"])


def test_actions_are_validated_against_the_tools() -> None:
    assert parse_action({"run": "ls"}, "w") == ToolCall("run", {"command": "ls"})
    assert parse_action("submit", "w") == ToolCall("submit", {})
    with pytest.raises(SuiteError, match=re.escape("x.yaml: solution[2]: unknown tool 'rm'")):
        parse_action({"rm": {}}, "x.yaml: solution[2]")
    with pytest.raises(SuiteError, match="missing required argument"):
        parse_action({"write_file": {"path": "a"}}, "w")


def _task(**change: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"id": "t", "category": "files", "instruction": "do it",
                            "check": "def check():\n    return False\n",
                            "solution": ["submit"], "wrong": ["submit"]}  # fmt: skip
    return {k: v for k, v in {**base, **change}.items() if v is not None}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"category": "two words"}, "field 'category' must be one word"),
        ({"check": None}, "missing field 'check'"),
        ({"check": "return True"}, "field 'check' must define check()"),
        ({"solution": []}, "field 'solution' must be a non-empty list"),
        ({"files": {"a": 1}}, "field 'files' must map file names to text"),
        ({"max_turns": 0}, "field 'max_turns' must be a positive integer"),
        ({"colour": "red"}, "unknown field 'colour'"),
    ],
)
def test_malformed_task_names_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(SuiteError, match=message):
        parse_task(_task(**change), "suite task t.yaml")


def test_rl_config_rejects_a_selection_that_matches_nothing() -> None:
    with pytest.raises(ValueError, match=re.escape("rl.agent.tasks / rl.agent.categories")):
        RLConfig(task_source="agent", agent=AgentTasksConfig(tasks=["no-such-*"]))
    RLConfig(task_source="prompts", agent=AgentTasksConfig(tasks=["no-such-*"]))  # unused
    with pytest.raises(ValueError, match=re.escape("rl.agent.context_tokens: must exceed")):
        AgentTasksConfig(context_tokens=64, max_new_tokens=64)


def test_a_user_category_and_no_wrong_sequence_are_accepted() -> None:
    task = parse_task(_task(category="cooking", wrong=None), "t.yaml")
    assert task.category == "cooking" and task.wrong == ()


def _write(directory: Path, name: str, **change: Any) -> Path:
    directory.mkdir(exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_task(id=name, **change)))
    return path


def test_task_dirs_add_to_the_suite_and_their_categories_select(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    _write(mine, "brew-tea", category="kitchen")
    _write(mine, "boil-egg", category="kitchen")
    tasks = select_tasks(categories=["kitchen"], dirs=[mine])
    assert [t.id for t in tasks] == ["boil-egg", "brew-tea"]
    assert tasks[0].source == str(mine / "boil-egg.yaml")
    assert len(all_tasks([mine])) == len(all_tasks()) + 2
    with pytest.raises(SuiteError, match="unknown task category 'kitchen'"):
        select_tasks(categories=["kitchen"])  # without the directory


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: _write(d, "c-fix-factorial"), "task id 'c-fix-factorial' is given twice"),
    (lambda d: _write(d, "a").rename(d / "b.yaml"), "id 'a' must match the file name"),
    (lambda d: _write(d, "x").write_text("id: [unclosed"), "x.yaml: not valid YAML"),
    (lambda d: d.mkdir(), "no \\*.yaml task files"),
    (lambda d: None, "not a directory"),
])  # fmt: skip
def test_a_bad_task_dir_is_refused_naming_the_file(
        tmp_path: Path, make: Callable[[Path], object], message: str) -> None:
    directory = tmp_path / "mine"
    make(directory)
    with pytest.raises(SuiteError, match=message):
        all_tasks([directory])


def test_rl_config_loads_task_dirs_at_start_up(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    _write(mine, "brew-tea", category="kitchen")
    cfg = RLConfig(task_source="agent", agent=AgentTasksConfig(
        tasks=["brew-*"], task_dirs=[str(mine)]))
    assert cfg.agent.task_dirs == [str(mine)]
    with pytest.raises(ValueError, match=r"rl\.agent\.task_dirs.*not a directory"):
        RLConfig(task_source="agent", agent=AgentTasksConfig(task_dirs=[str(tmp_path / "no")]))
