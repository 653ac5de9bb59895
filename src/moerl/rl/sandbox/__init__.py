"""Isolated execution of untrusted programs: bubblewrap + cgroups + rlimits + seccomp."""

from moerl.rl.sandbox.config import Limits, SandboxConfig
from moerl.rl.sandbox.result import ExecutionResult, ExecutionStatus
from moerl.rl.sandbox.runner import Sandbox, SandboxUnavailable
from moerl.rl.sandbox.workspace import Workspace

__all__ = [
    "ExecutionResult",
    "ExecutionStatus",
    "Limits",
    "Sandbox",
    "SandboxConfig",
    "SandboxUnavailable",
    "Workspace",
]
