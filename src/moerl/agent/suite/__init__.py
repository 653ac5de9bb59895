"""Terminal tasks: the ones that ship with moerl (one YAML file per task in `tasks/`)
and a user's own, in the same format, from directories (`rl.agent.task_dirs`,
`moerl eval agent --tasks-dir DIR`).

Each file holds what the model is told (`instruction`), the work dir it starts from
(`files`, plus an optional bash `setup` such as building a git history), the verifier
(`check`: Python defining `check() -> bool | float`, run inside the sandbox by
terminal.py's harness with its `run` and `read` helpers), a scripted `solution` and,
optionally, a plausible but `wrong` action sequence. The category is free-form (the
shipped ones are `CATEGORIES`). Actions are written compactly:

    - run: gcc -o hello hello.c          # {"command": ...}
    - write_file: {path: a.txt, content: "x\\n"}
    - submit

The tests replay every shipped solution (reward 1) and every wrong or empty sequence
(reward 0) through the real sandbox, so a verifier that accepts too much fails them;
`moerl eval agent --check DIR` does the same for a user's directory.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from moerl.agent.environment import AgentTask
from moerl.agent.terminal import TOOLS
from moerl.agent.tools import ToolCall, ToolCallError, parse_tool_call

CATEGORIES = ("files", "fix-test", "c", "logs", "git")
"""The shipped tasks' categories; a user's task may name any other."""
_KEYS = {"id", "category", "instruction", "files", "setup", "check", "solution", "wrong",
         "max_turns"}  # fmt: skip
_REQUIRED = ("id", "category", "instruction", "check", "solution")


class SuiteError(ValueError):
    """A task file or a task selection that cannot be used; the message says which."""


@dataclass(frozen=True)
class SuiteTask:
    task: AgentTask
    category: str
    solution: tuple[ToolCall, ...]
    """Solves the task (the verifier gives 1.0)."""
    wrong: tuple[ToolCall, ...]
    """A plausible mistake (the verifier gives 0.0); empty when the file gives none."""
    source: str = ""
    """The file it came from."""

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
    if any(c.isspace() for c in data["category"]):
        raise SuiteError(f"{where}: field 'category' must be one word, got "
                         f"{data['category']!r}")
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
    actions: dict[str, tuple[ToolCall, ...]] = {"wrong": ()}
    for key in ("solution", "wrong"):
        if key not in data:
            continue
        if not isinstance(data[key], list) or not data[key]:
            raise SuiteError(f"{where}: field {key!r} must be a non-empty list of actions")
        actions[key] = tuple(parse_action(a, f"{where}: {key}[{i}]")
                             for i, a in enumerate(data[key]))  # fmt: skip
    task = AgentTask(data["id"], data["instruction"].strip(), files, data["check"],
                     max_turns=max_turns, setup=setup)  # fmt: skip
    return SuiteTask(task, data["category"], actions["solution"], actions["wrong"], where)


def load_task_file(path: Path | Traversable, where: str) -> SuiteTask:
    """One task file, validated: its id must be its file name."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise SuiteError(f"{where}: cannot read it ({err})") from err
    except yaml.YAMLError as err:
        raise SuiteError(f"{where}: not valid YAML ({err})") from err
    task = parse_task(data, where)
    if f"{task.id}.yaml" != path.name:
        raise SuiteError(f"{where}: id {task.id!r} must match the file name "
                         f"({task.id}.yaml)")
    return task


def task_files(directory: Path) -> list[Path]:
    """The task files of a user's directory (`*.yaml`, sorted); an error naming the
    directory when it is missing or holds none."""
    if not directory.is_dir():
        raise SuiteError(f"task directory {directory}: not a directory")
    found = sorted(directory.glob("*.yaml"))
    if not found:
        raise SuiteError(f"task directory {directory}: no *.yaml task files")
    return found


def all_tasks(dirs: Sequence[str | Path] = ()) -> list[SuiteTask]:
    """Every shipped task, sorted by id, then each of `dirs`' tasks; an id given twice
    is an error naming both files."""
    folder = resources.files(__name__).joinpath("tasks")
    tasks = [load_task_file(entry, f"suite task {entry.name}")
             for entry in sorted(folder.iterdir(), key=lambda e: e.name)
             if entry.name.endswith(".yaml")]
    for directory in dirs:
        tasks += [load_task_file(path, str(path)) for path in task_files(Path(directory))]
    seen: dict[str, str] = {}
    for task in tasks:
        if task.id in seen:
            raise SuiteError(f"task id {task.id!r} is given twice: {seen[task.id]} and "
                             f"{task.source}")
        seen[task.id] = task.source
    return tasks


def select_tasks(patterns: Sequence[str] = (), categories: Sequence[str] = (),
                 dirs: Sequence[str | Path] = ()) -> list[SuiteTask]:
    """Tasks (shipped, and from `dirs`) whose id matches any glob in `patterns` (all when
    empty) and whose category is in `categories` (all when empty). A pattern or category
    that selects nothing is an error: a typo must not silently shrink an evaluation."""
    tasks = all_tasks(dirs)
    known = sorted({t.category for t in tasks})
    bad = sorted(set(categories) - set(known))
    if bad:
        raise SuiteError(f"unknown task category {bad[0]!r}; categories: {', '.join(known)}")
    tasks = [t for t in tasks if not categories or t.category in categories]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(t.id, pattern) for t in tasks):
            raise SuiteError(f"task pattern {pattern!r} matches no task"
                             + (f" in categories {list(categories)}" if categories else "")
                             + "; list them with `moerl eval agent --list`")  # fmt: skip
    if patterns:
        tasks = [t for t in tasks if any(fnmatch.fnmatchcase(t.id, p) for p in patterns)]
    return tasks
