"""Plug-in contract: an environment loaded by import path satisfies the protocol, its
scripted solution scores 1 and the untouched task 0, snapshot/restore round-trips;
bad import paths fail with a clear message."""

import pytest

from moerl.agent.environment import Environment, EnvironmentLoadError, load_environment
from moerl.agent.tasks import generate_tasks
from moerl.agent.tools import ToolCall
from moerl.sandbox import Sandbox

BUILTIN = ["moerl.agent.terminal:TerminalEnvironment"]


@pytest.mark.sandbox
@pytest.mark.parametrize("path", BUILTIN)
def test_builtin_environments_honour_the_contract(sandbox: Sandbox, path: str) -> None:
    env = load_environment(path, sandbox)
    assert isinstance(env, Environment)
    case = generate_tasks(3, seed=7)[2]  # fix_module: several steps, one failing on purpose
    try:
        first = env.reset(case.task)
        assert first.fault is None and "mathlib.py" in first.text
        assert env.verify().reward == 0.0
        observations = [env.step(call) for call in case.solution]
        assert observations[0].error and not observations[2].error and observations[-1].done
        assert env.verify().reward == 1.0
        assert env.snapshot()
        env.step(ToolCall("run", {"command": "rm -f mathlib.py"}))
        assert env.verify().reward == 0.0
        assert env.restore() and env.verify().reward == 1.0
    finally:
        env.close()


class NotAnEnvironment:
    def __init__(self, sandbox: object) -> None:
        pass


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("moerl.agent.terminal.TerminalEnvironment", "must look like"),
        ("moerl.agent.nope:Env", "cannot import module"),
        ("moerl.agent.terminal:Nope", "has no attribute 'Nope'"),
        ("moerl.agent.terminal:TOOLS", "not callable"),
        (f"{__name__}:NotAnEnvironment", "lacks part of the Environment protocol"),
    ],
)
def test_bad_import_paths_fail_with_a_clear_message(path: str, message: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=message):
        load_environment(path, None)
