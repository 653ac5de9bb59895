"""The terminal tasks that ship with moerl: one YAML file per task in `tasks/`.

Each file holds what the model is told (`instruction`), the work dir it starts from
(`files`, plus an optional bash `setup` such as building a git history), the verifier
(`check`: Python defining `check() -> bool | float`, run inside the sandbox by
terminal.py's harness with its `run` and `read` helpers), a scripted `solution` and a
plausible but `wrong` action sequence. Actions are written compactly:

    - run: gcc -o hello hello.c          # {"command": ...}
    - write_file: {path: a.txt, content: "x\\n"}
    - submit

The tests replay every solution (reward 1) and every wrong or empty sequence (reward 0)
through the real sandbox, so a verifier that accepts too much fails them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from moerl.agent.environment import AgentTask
from moerl.agent.terminal import TOOLS
from moerl.agent.tools import ToolCall, ToolCallError, parse_tool_call

CATEGORIES = ("files", "fix-test", "c", "logs", "git")
_KEYS = {"id", "category", "instruction", "files", "setup", "check", "solution", "wrong",
         "max_turns"}  # fmt: skip
_REQUIRED = ("id", "category", "instruction", "check", "solution", "wrong")


class SuiteError(ValueError):
    """A task file or a task selection that cannot be used; the message says which."""


@dataclass(frozen=True)
class SuiteTask:
    task: AgentTask
    category: str
    solution: tuple[ToolCall, ...]
    """Solves the task (the verifier gives 1.0)."""
    wrong: tuple[ToolCall, ...]
    """A plausible mistake (the verifier gives 0.0)."""

    @property
    def id(self) -> str:
        return self.task.id


def parse_action(item: Any, where: str) -> ToolCall:
    """`{"run": "ls"}`, `{"write_file": {...}}`, `"submit"` -> a validated ToolCall."""
    arguments: Any
    if isinstance(item, str):
        name, arguments = item, {}
    elif isinstance(item, dict) and len(item) == 1:
        ((name, value),) = item.items()
        arguments = {"command": value} if name == "run" and isinstance(value, str) else value
    else:
        raise SuiteError(f"{where}: an action is a tool name or a one-key mapping, got {item!r}")
    if not isinstance(arguments, dict):
        raise SuiteError(f"{where}: arguments of {name!r} must be a mapping, got {arguments!r}")
    call = parse_tool_call(ToolCall(str(name), arguments).to_text(), TOOLS)
    if isinstance(call, ToolCallError):
        raise SuiteError(f"{where}: {call.message}")
    return call


def parse_task(data: Any, where: str) -> SuiteTask:
    """One task file's content, validated; errors name the file and the field."""
    if not isinstance(data, dict):
        raise SuiteError(f"{where}: expected a mapping of task fields")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise SuiteError(f"{where}: unknown field {unknown[0]!r}; known: {sorted(_KEYS)}")
    for key in _REQUIRED:
        if key not in data:
            raise SuiteError(f"{where}: missing field {key!r}")
    for key in ("id", "category", "instruction", "check"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise SuiteError(f"{where}: field {key!r} must be a non-empty string")
    if data["category"] not in CATEGORIES:
        raise SuiteError(f"{where}: category {data['category']!r} is not one of {CATEGORIES}")
    files = data.get("files") or {}
    if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in files.items()):  # fmt: skip
        raise SuiteError(f"{where}: field 'files' must map file names to text")
    setup = data.get("setup") or ""
    max_turns = data.get("max_turns")
    if not isinstance(setup, str):
        raise SuiteError(f"{where}: field 'setup' must be a bash script (a string)")
    if max_turns is not None and (type(max_turns) is not int or max_turns < 1):
        raise SuiteError(f"{where}: field 'max_turns' must be a positive integer")
    if "def check(" not in data["check"]:
        raise SuiteError(f"{where}: field 'check' must define check()")
    actions = {}
    for key in ("solution", "wrong"):
        if not isinstance(data[key], list) or not data[key]:
            raise SuiteError(f"{where}: field {key!r} must be a non-empty list of actions")
        actions[key] = tuple(parse_action(a, f"{where}: {key}[{i}]")
                             for i, a in enumerate(data[key]))  # fmt: skip
    task = AgentTask(data["id"], data["instruction"].strip(), files, data["check"],
                     max_turns=max_turns, setup=setup)  # fmt: skip
    return SuiteTask(task, data["category"], actions["solution"], actions["wrong"])


def all_tasks() -> list[SuiteTask]:
    """Every shipped task, sorted by id."""
    folder = resources.files(__name__).joinpath("tasks")
    tasks = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".yaml"):
            continue
        where = f"suite task {entry.name}"
        try:
            data = yaml.safe_load(entry.read_text())
        except yaml.YAMLError as err:
            raise SuiteError(f"{where}: not valid YAML ({err})") from err
        task = parse_task(data, where)
        if f"{task.id}.yaml" != entry.name:
            raise SuiteError(f"{where}: id {task.id!r} must match the file name")
        tasks.append(task)
    return tasks


def select_tasks(patterns: Sequence[str] = (), categories: Sequence[str] = ()) -> list[SuiteTask]:
    """Tasks whose id matches any glob in `patterns` (all when empty) and whose category
    is in `categories` (all when empty). A pattern or category that selects nothing is
    an error: a typo must not silently shrink an evaluation."""
    bad = sorted(set(categories) - set(CATEGORIES))
    if bad:
        raise SuiteError(f"unknown task category {bad[0]!r}; categories: {', '.join(CATEGORIES)}")
    tasks = [t for t in all_tasks() if not categories or t.category in categories]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(t.id, pattern) for t in tasks):
            raise SuiteError(f"task pattern {pattern!r} matches no task"
                             + (f" in categories {list(categories)}" if categories else "")
                             + "; list them with `moerl eval agent --list`")  # fmt: skip
    if patterns:
        tasks = [t for t in tasks if any(fnmatch.fnmatchcase(t.id, p) for p in patterns)]
    return tasks
