"""A terminal environment over the sandbox: a persistent work dir per episode.

Every command runs in its own sandboxed execution (bubblewrap, unprivileged uid, limits)
bound to the episode's work dir, so files survive between commands while processes do
not. Limits a tool call asks for are clamped to `TerminalConfig.max_command_limits` (and
again to the sandbox's maxima). Output is cut to `max_output_chars` with a marker.

Snapshots are a tar of the work dir made *inside* the sandbox, and restores untar inside
it too: the host never follows a link or parses an archive the model could have shaped.

The verifier runs the task's `check` inside the sandbox under the harness shared with
the code rewards (`rewards/pyharness.py check`), which reports
through the result channel, a pipe the program's exit code and stdout cannot reach. The
check's source and a nonce reach the harness on stdin (no file inside holds them), the
verdict must carry the nonce, and agent code started by the check (`run([...])`) gets
neither the channel fd nor stdin: the harness also marks itself non-dumpable, so even a
same-uid child cannot open its fds or memory through /proc. A check should compare
values it holds against what agent code prints, never trust an exit code alone.
"""

from __future__ import annotations

import io
import json
import math
import os
import secrets
import tarfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moerl.agent.environment import AgentTask, Observation, VerifyResult
from moerl.agent.tools import ToolCall, ToolSpec
from moerl.rewards.code import HARNESS, HARNESS_INSIDE
from moerl.sandbox import ExecutionResult, ExecutionStatus, Limits, Sandbox, Workspace

TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("run", "Run a bash command in the task's work dir (/work).",
             {"command": {"type": "string", "description": "bash command line"},
              "timeout_s": {"type": "number", "description": "wall-clock limit (clamped)"}},
             required=("command",)),
    ToolSpec("write_file", "Write a text file (relative to /work), replacing it if it exists.",
             {"path": {"type": "string"}, "content": {"type": "string"}},
             required=("path", "content")),
    ToolSpec("submit", "Declare the task finished; the result is then checked."),
)  # fmt: skip


@dataclass(frozen=True)
class TerminalConfig:
    command_limits: Limits = field(
        default_factory=lambda: Limits(wall_time_s=10, cpu_time_s=10, memory_mb=512)
    )
    """Limits of a command that asks for nothing."""
    max_command_limits: Limits = field(
        default_factory=lambda: Limits(wall_time_s=30, cpu_time_s=30, memory_mb=1024)
    )
    """No tool call can raise a limit above these (nor above the sandbox's maxima)."""
    verify_limits: Limits = field(
        default_factory=lambda: Limits(wall_time_s=30, cpu_time_s=30, memory_mb=1024)
    )
    max_output_chars: int = 4000
    """Per observation; the middle is cut, the head and the tail (often the error) kept."""
    snapshot_max_bytes: int = 8 << 20
    """A work dir whose tar is larger cannot be snapshotted (the previous snapshot stays)."""

    def __post_init__(self) -> None:
        if self.max_output_chars < 200:
            raise ValueError("TerminalConfig.max_output_chars must be >= 200")
        object.__setattr__(
            self, "command_limits", self.command_limits.clamped_to(self.max_command_limits)
        )


def cut_middle(text: str, limit: int) -> tuple[str, bool]:
    """`text` within `limit` chars: head + explicit marker + tail. Returns (text, was_cut)."""
    if len(text) <= limit:
        return text, False
    keep = limit - 60
    head, tail = keep // 2, keep - keep // 2
    dropped = len(text) - head - tail
    return f"{text[:head]}\n[... {dropped} characters truncated ...]\n{text[-tail:]}", True


def _tar_of(files: dict[str, str]) -> bytes:
    """An archive of regular files only, built on the host from trusted task data."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class TerminalEnvironment:
    """`Environment` over a `Sandbox`. One episode at a time; `close` removes its files."""

    def __init__(self, sandbox: Sandbox | None, config: TerminalConfig | None = None) -> None:
        if sandbox is None:
            raise ValueError("TerminalEnvironment needs a Sandbox")
        self.sandbox = sandbox
        self.config = config or TerminalConfig()
        self._workspace: Workspace | None = None
        self._snapshot: bytes | None = None
        self._task: AgentTask | None = None
        # Guards the work dir swap: a step abandoned by the scheduler's timeout may still
        # be running in a thread while `restore` replaces the directory under it.
        self._lock = threading.Lock()

    @property
    def tools(self) -> tuple[ToolSpec, ...]:
        return TOOLS

    @property
    def work_dir(self) -> Path | None:
        return self._workspace.path if self._workspace is not None else None

    # -- episode ------------------------------------------------------------------------

    def reset(self, task: AgentTask) -> Observation:
        self.close()
        self._task = task
        self._workspace = self.sandbox.workspace()
        if task.files:
            result = self._exec(["/usr/bin/tar", "-x", "-f", "-", "-C", "/work"],
                                stdin=_tar_of(dict(task.files)))  # fmt: skip
            if result.status is not ExecutionStatus.OK:
                return Observation("", fault=f"cannot set up the work dir: {_why(result)}")
        if task.setup:
            result = self._exec(["/bin/bash", "-e", "-c", task.setup])
            if result.status is not ExecutionStatus.OK:
                return Observation("", fault=f"the task's setup failed: {_why(result)}")
        self._snapshot = None
        if not self.snapshot():
            return Observation("", fault="cannot snapshot the initial work dir")
        return Observation(f"Files in /work:\n{self._listing(task)}")

    def step(self, call: ToolCall) -> Observation:
        if call.name == "submit":
            return Observation("submitted", done=True)
        if call.name == "write_file":
            script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
            result = self._exec(["/bin/bash", "-c", script, "write_file", call.arguments["path"]],
                                stdin=call.arguments["content"].encode())  # fmt: skip
            if result.status is ExecutionStatus.OK:
                return Observation(f"wrote {len(call.arguments['content'])} characters")
            return self._render(result)
        if call.name == "run":
            limits = self._command_limits(call.arguments.get("timeout_s"))
            return self._render(self._exec(["/bin/bash", "-c", call.arguments["command"]], limits))
        return Observation(f"unknown tool {call.name!r}", error=True)

    def verify(self) -> VerifyResult:
        if self._task is None or self._workspace is None:
            return VerifyResult(None, infra_error="verify() before reset()")
        nonce = secrets.token_hex(16)
        result = self._exec(
            [self.sandbox.config.python_path, "-I", "-S", HARNESS_INSIDE, "check"],
            self.config.verify_limits, stdin=f"{nonce}\n{self._task.check}".encode(),
            channel=True, extra_ro_binds=[(HARNESS, HARNESS_INSIDE)],
        )  # fmt: skip
        return _verdict(result, nonce)

    def snapshot(self) -> bool:
        snap = replace(self.config.command_limits, max_output_bytes=self.config.snapshot_max_bytes)
        result = self._exec(["/usr/bin/tar", "-c", "-f", "-", "-C", "/work", "."], snap)
        if result.status is not ExecutionStatus.OK or result.stdout_truncated:
            return False
        self._snapshot = result.stdout
        return True

    def restore(self) -> bool:
        """A fresh work dir filled from the last snapshot; the old one is removed."""
        if self._snapshot is None:
            return False
        fresh = self.sandbox.workspace()
        result = self.sandbox.run(
            ["/usr/bin/tar", "-x", "-f", "-", "-C", "/work"],
            fresh,
            stdin=self._snapshot,
            limits=self.config.command_limits,
        )
        if result.status is not ExecutionStatus.OK:
            fresh.remove()
            return False
        with self._lock:
            old, self._workspace = self._workspace, fresh
        if old is not None:
            old.remove()
        return True

    def close(self) -> None:
        with self._lock:
            old, self._workspace = self._workspace, None
        if old is not None:
            old.remove()

    def saved(self) -> tuple[AgentTask, bytes] | None:
        """The task and the last snapshot, for a replacement of this environment
        (`resume`) after it crashed; None before the first snapshot."""
        if self._task is None or self._snapshot is None:
            return None
        return self._task, self._snapshot

    def resume(self, task: AgentTask, snapshot: bytes) -> bool:
        """Take over another environment's episode at its last snapshot."""
        self._task, self._snapshot = task, snapshot
        return self.restore()

    # -- helpers ------------------------------------------------------------------------

    def _listing(self, task: AgentTask, most: int = 200) -> str:
        """The work dir's files after the setup (a `.git` dir as one entry), read inside
        the sandbox; the task's own file names if that fails."""
        result = self._exec(["/usr/bin/find", "/work", "-mindepth", "1", "-name", ".git",
                             "-prune", "-printf", "%P/\n", "-o", "-type", "f", "-printf",
                             "%P\n", "-o", "-type", "l", "-printf", "%P\n"])  # fmt: skip
        if result.status is not ExecutionStatus.OK or result.stdout_truncated:
            names = sorted(task.files)
        else:
            names = sorted(result.text("stdout").splitlines())
        if len(names) > most:
            names = [*names[:most], f"... and {len(names) - most} more"]
        return "\n".join(names) or "(empty)"

    def _command_limits(self, timeout_s: Any) -> Limits:
        base = self.config.command_limits
        if isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0:
            base = replace(base, wall_time_s=float(timeout_s), cpu_time_s=float(timeout_s))
        return base.clamped_to(self.config.max_command_limits)

    def _exec(
        self,
        argv: list[str],
        limits: Limits | None = None,
        *,
        stdin: bytes = b"",
        channel: bool = False,
        extra_ro_binds: Sequence[tuple[Path, str]] = (),
    ) -> ExecutionResult:
        with self._lock:
            workspace = self._workspace
        if workspace is None:
            return ExecutionResult(ExecutionStatus.SANDBOX_ERROR, None, None, b"", b"", False,
                                   False, 0.0, 0.0, None, error="no work dir")  # fmt: skip
        if workspace.path.is_dir() and not workspace.path.is_symlink():
            # The model may chmod its own /work to 000; bwrap would then fail to enter it
            # and the model's mistake would read as an infra fault (and go unscored).
            os.chmod(workspace.path, 0o755)
        return self.sandbox.run(
            argv,
            workspace,
            stdin=stdin,
            limits=limits or self.config.command_limits,
            channel=channel,
            extra_ro_binds=extra_ro_binds,
        )

    def _render(self, result: ExecutionResult) -> Observation:
        if result.is_infra_error:
            return Observation("", fault=f"sandbox error: {result.error}")
        parts = [f"exit code: {result.exit_code if result.exit_code is not None else 'none'}"]
        if result.status is ExecutionStatus.TIMEOUT:
            parts.append(f"the command was killed at its time limit ({result.wall_time_s:.1f}s)")
        elif result.status in (ExecutionStatus.MEMORY_LIMIT, ExecutionStatus.OUTPUT_LIMIT):
            parts.append(f"the command was killed: {result.status.value}")
        for name in ("stdout", "stderr"):
            text = result.text(name)
            if getattr(result, f"{name}_truncated"):
                text += "\n[... output cut by the sandbox's limit ...]"
            if text:
                parts.append(f"{name}:\n{text}")
        text, cut = cut_middle("\n".join(parts), self.config.max_output_chars)
        error = result.status is not ExecutionStatus.OK
        return Observation(text, error=error, truncated=cut or result.stdout_truncated)


def _why(result: ExecutionResult) -> str:
    if result.error:
        return result.error
    code = "" if result.exit_code is None else f" (exit code {result.exit_code})"
    stderr = result.text("stderr")[-500:].strip()
    return f"{result.status.value}{code}" + (f": {stderr}" if stderr else "")


def _verdict(result: ExecutionResult, nonce: str) -> VerifyResult:
    """Reward from the channel only. A run that never started is infra; one that started
    but left no valid verdict (killed at a limit by code the model wrote) scores 0."""
    details: dict[str, Any] = {"status": result.status.value}
    if result.is_infra_error:
        return VerifyResult(None, infra_error=f"verifier sandbox error: {result.error}")
    try:
        verdict = json.loads(result.channel.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return VerifyResult(0.0, details={**details, "error": "no valid verdict on the channel"})
    score = verdict.get("score") if isinstance(verdict, dict) else None
    if (not isinstance(verdict, dict) or verdict.get("nonce") != nonce
            or type(score) is not float or not 0.0 <= score <= 1.0):  # fmt: skip
        return VerifyResult(0.0, details={**details, "error": "verdict without this run's nonce"})
    if verdict.get("error"):
        details["check_error"] = str(verdict["error"])
    return VerifyResult(score, details=details)
