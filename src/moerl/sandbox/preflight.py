"""A server's check, at start-up, that its sandbox can run anything at all.

A setting under which every execution fails (a work root the sandbox user cannot
reach through an ACL, cgroups it may not write, a missing /bin/sh) would otherwise
come out as an infra error on every item, retried and never scored. One trivial
program is run the way items are: in a fresh work dir, reading a file written there
from the host and writing one back, as the sandbox user.
"""

from __future__ import annotations

import secrets

from moerl.sandbox.config import SandboxConfig
from moerl.sandbox.result import ExecutionStatus
from moerl.sandbox.runner import Sandbox, SandboxUnavailable
from moerl.sandbox.workspace import UnsafePath

_PROBE = ["/bin/sh", "-c", "cat probe.in > probe.out"]


def check_sandbox(sandbox: Sandbox) -> None:
    """Raise SandboxUnavailable, naming the work root and the fix, unless a probe program
    runs in `sandbox` and round-trips a file through its work dir."""
    token = secrets.token_hex(8)
    root = sandbox.config.work_root
    with sandbox.workspace() as workspace:
        workspace.write("probe.in", token)
        result = sandbox.run(_PROBE, workspace)
        try:
            echoed = workspace.read("probe.out", 64).decode(errors="replace")
        except UnsafePath:
            echoed = None
    if result.status is ExecutionStatus.OK and echoed == token:
        return
    why = result.error or f"status {result.status.value}: {result.text('stderr')[-300:]!r}"
    raise SandboxUnavailable(
        f"the sandbox cannot run a probe program ({why.strip()}), so every item would be an "
        f"infra error. Work dirs are under {root}: the sandbox user (uid "
        f"{sandbox.config.sandbox_uid}) must be able to search it and every directory above "
        "it. Fix: set TMPDIR to such a directory, or give that user search permission "
        "(chmod o+x) on the one in the way")


def open_checked(config: SandboxConfig) -> Sandbox:
    """A sandbox that has run the probe (`check_sandbox`); SandboxUnavailable, with
    nothing of it left running, otherwise."""
    sandbox = Sandbox(config)
    try:
        check_sandbox(sandbox)
    except SandboxUnavailable:
        sandbox.close()
        raise
    return sandbox
