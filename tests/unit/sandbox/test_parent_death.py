"""RELIABILITY.md case 11: SIGKILL of the process that owns the sandbox kills everything
inside, setsid'd daemons included, and the next sandbox removes the dead owner's groups."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from proc_scan import processes_with

from moerl.sandbox import Sandbox, SandboxConfig

pytestmark = pytest.mark.sandbox
SRC = Path(__file__).resolve().parents[3] / "src"


def test_sigkill_of_the_owner_kills_sandboxed_children(sandbox: Sandbox) -> None:
    marker = f"moerl-orphan-{uuid.uuid4().hex}"
    owner_script = textwrap.dedent(f"""
        import threading
        from moerl.sandbox import Sandbox, Limits
        sb = Sandbox()
        def work():
            with sb.workspace() as ws:
                nap = "/usr/bin/python3 -c 'import time; time.sleep(1000)'"
                ws.write("main.sh", f"setsid {{nap}} {marker} & {{nap}} {marker}-main")
                sb.run(["/bin/sh", "main.sh"], ws, limits=Limits(wall_time_s=60))
        t = threading.Thread(target=work)  # like a server's worker thread
        t.start()
        t.join()
    """)
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_script], env={**os.environ, "PYTHONPATH": str(SRC)}
    )
    try:
        # Generous: on a loaded machine starting two interpreters in bwrap takes a while.
        deadline = time.monotonic() + 45
        while len(processes_with(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(processes_with(marker)) >= 2, "sandboxed processes never started"
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 15
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(marker) == []
    finally:
        owner.kill()
        owner.wait()
    # The dead owner's cgroups are found by name and removed by the next sandbox.
    assert sandbox.layout is not None
    stale = [p for b in sandbox.layout.bases.values() for p in b.glob(f"{owner.pid}-*")]
    assert stale, "expected the killed owner to leave its (empty) cgroups behind"
    stale_work = list(Path(tempfile.gettempdir(), "moerl-sandbox-work").glob(f"run-{owner.pid}-*"))
    assert stale_work, "expected the killed owner to leave its work dir behind"
    Sandbox(SandboxConfig())
    assert [p for p in stale + stale_work if p.exists()] == []
