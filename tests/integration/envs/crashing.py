"""An environment for the environment server's tests: the terminal, except that a
`run` of the command `crash!` raises, as an environment whose own machinery broke."""

from __future__ import annotations

from moerl.agent.environment import Observation
from moerl.agent.terminal import TerminalEnvironment
from moerl.agent.tools import ToolCall


class CrashingTerminal(TerminalEnvironment):
    def step(self, call: ToolCall) -> Observation:
        if call.name == "run" and call.arguments.get("command") == "crash!":
            raise RuntimeError("the environment broke")
        return super().step(call)
