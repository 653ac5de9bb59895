"""Isolated execution of untrusted programs: bubblewrap + cgroups + rlimits + seccomp."""

from moerl.sandbox.config import Limits, SandboxConfig
from moerl.sandbox.result import ExecutionResult, ExecutionStatus
from moerl.sandbox.runner import Sandbox, SandboxUnavailable
from moerl.sandbox.workspace import Workspace

__all__ = [
    "ExecutionResult",
    "ExecutionStatus",
    "Limits",
    "Sandbox",
    "SandboxConfig",
    "SandboxUnavailable",
    "Workspace",
]
