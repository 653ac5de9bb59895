"""The seam between the agent scheduler and a stateful environment.

An environment holds one episode's state (a work dir, a simulator, ...). The scheduler
calls `reset(task)` once, then `step(call)` per model action, and `verify()` at the end.
`snapshot()` / `restore()` let the scheduler recover from a fault of the environment
itself (its sandbox crashed, its state vanished) without charging the model for it.

Three kinds of trouble are kept apart, because only one of them is the model's:

- the model's action failed (a command exited non-zero, a file was missing): an ordinary
  observation with `error=True`; the model sees it and may retry;
- the environment failed (`fault` is set): the scheduler restores the last snapshot, or
  after too many faults marks the episode an infra failure, never scored;
- verification failed to run (`VerifyResult.infra_error`): likewise never a reward of 0.

Environments plug in by import path ("package.module:attr"); the attribute is a factory
taking the shared `Sandbox` (which it may ignore) and returning an `Environment`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from moerl.agent.tools import ToolCall, ToolSpec
from moerl.sandbox import Sandbox


@dataclass(frozen=True)
class AgentTask:
    """One task: what the model is told, the files it starts with, and how success is
    checked. `check` is Python source defining `check() -> bool | float` (see terminal.py
    for the helpers it may use); the model never sees it."""

    id: str
    instruction: str
    files: Mapping[str, str] = field(default_factory=dict)
    check: str = ""
    max_turns: int | None = None
    """Overrides the scheduler's turn limit for this task, if set."""
    setup: str = ""
    """bash run in the work dir after `files` are written, before the first snapshot
    (e.g. to build a git history); the model does not see it."""


@dataclass(frozen=True)
class Observation:
    text: str
    done: bool = False
    """The episode is over (the model submitted)."""
    error: bool = False
    """The model's action failed; counts toward the scheduler's bounded retries."""
    fault: str | None = None
    """The environment itself failed (infra); `text` is not shown to the model."""
    truncated: bool = False
    """The environment cut the output to its limit (a marker is in `text`)."""


@dataclass(frozen=True)
class VerifyResult:
    reward: float | None
    """In [0, 1]; None exactly when `infra_error` is set."""
    infra_error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.reward is None) == (self.infra_error is None):
            raise ValueError("a VerifyResult has either a reward or an infra_error")
        if self.reward is not None and not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"reward must be in [0, 1], got {self.reward}")


@runtime_checkable
class Environment(Protocol):
    """One episode at a time; not shared between concurrent episodes."""

    @property
    def tools(self) -> Sequence[ToolSpec]: ...

    def reset(self, task: AgentTask) -> Observation:
        """Start `task` from its initial state; the observation is shown after the task."""
        ...

    def step(self, call: ToolCall) -> Observation:
        """Execute one validated tool call."""
        ...

    def verify(self) -> VerifyResult:
        """Score the current state with the task's check; unforgeable by the model."""
        ...

    def snapshot(self) -> bool:
        """Remember the current state; False when it could not (the old one is kept)."""
        ...

    def restore(self) -> bool:
        """Return to the last snapshot; False when that is impossible."""
        ...

    def close(self) -> None: ...


class EnvironmentLoadError(ValueError):
    pass


def load_environment(path: str, sandbox: Sandbox | None, **kwargs: Any) -> Environment:
    """Build an environment from "package.module:attr", called as attr(sandbox, **kwargs)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise EnvironmentLoadError(
            f"environment path {path!r} must look like 'package.module:attr'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvironmentLoadError(f"cannot import module {module_name!r} for {path!r}: {exc}"
                                   ) from exc  # fmt: skip
    factory = getattr(module, attr, None)
    if factory is None:
        raise EnvironmentLoadError(f"module {module_name!r} has no attribute {attr!r} ({path!r})")
    if not callable(factory):
        raise EnvironmentLoadError(f"{path!r} is not callable; expected an environment factory")
    env = factory(sandbox, **kwargs)
    if not isinstance(env, Environment):
        raise EnvironmentLoadError(
            f"{path!r} built {type(env).__name__}, which lacks part of the Environment protocol "
            "(tools, reset, step, verify, snapshot, restore, close)"
        )
    return env
