"""The shipped task suite as data: it loads, covers every category, and malformed task
files fail with the file and the field named (no sandbox needed here)."""

from __future__ import annotations

import collections
import re
from typing import Any

import pytest

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
        ({"category": "cooking"}, "category 'cooking' is not one of"),
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
