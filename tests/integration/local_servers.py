"""A real rollout server process on 127.0.0.1 serving a random tiny MoE, for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moerl.rl.rollout.client import RolloutClient, discover


@contextmanager
def rollout_server(rendezvous: Path, seed: int) -> Iterator[RolloutClient]:
    """Start `moerl.rl.rollout.server`, wait until it announces itself in `rendezvous`,
    yield a client for it, and stop it (SIGTERM, then SIGKILL) afterwards."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moerl.rl.rollout.server", "--host", "127.0.0.1", "--port", "0",
         "--seed", str(seed), "--rendezvous-dir", str(rendezvous), "--max-batch", "8"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180  # generous: the machine may be shared
        while not discover(rendezvous):
            if proc.poll() is not None:
                assert proc.stderr is not None
                raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-3000:]}")
            assert time.monotonic() < deadline, "rollout server did not come up"
            time.sleep(0.2)
        client = RolloutClient(rendezvous_dir=rendezvous)
        yield client
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
