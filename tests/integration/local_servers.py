"""Real server processes on 127.0.0.1 for tests: a rollout server serving a random tiny
MoE, a reward server with the built-in rewards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moerl.rendezvous import read_endpoints
from moerl.rollout.client import RolloutClient


@contextmanager
def rollout_server(rendezvous: Path, seed: int) -> Iterator[RolloutClient]:
    """A rollout server announced in `rendezvous` and a client for it, stopped after."""
    with started(rollout_command(rendezvous, seed), rendezvous, "rollout"):
        client = RolloutClient(rendezvous_dir=rendezvous)
        yield client
        client.close()


def rollout_command(rendezvous: Path, seed: int, port: int = 0) -> list[str]:
    return [sys.executable, "-m", "moerl.rollout.server", "--host", "127.0.0.1",
            "--port", str(port), "--seed", str(seed), "--rendezvous-dir", str(rendezvous),
            "--max-batch", "8"]


def reward_command(rendezvous: Path, port: int = 0) -> list[str]:
    return [sys.executable, "-m", "moerl.rewards.server", "--host", "127.0.0.1",
            "--port", str(port), "--max-concurrency", "2", "--rendezvous-dir", str(rendezvous),
            "--reward", "stdio=stdio", "--reward", "format=format"]


@contextmanager
def started(argv: list[str], rendezvous: Path, stage: str, env: dict[str, str] | None = None
            ) -> Iterator[subprocess.Popen[bytes]]:
    """Run `argv` until it announces a `stage` endpoint in `rendezvous` (a directory of
    its own); yield the process; stop it afterwards (SIGTERM, then SIGKILL) if it runs.
    `env`: variables set for it on top of this process's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    assert not read_endpoints(rendezvous, stage), f"{rendezvous} has a {stage} endpoint already"
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180  # generous: the machine may be shared
        while not read_endpoints(rendezvous, stage):
            if proc.poll() is not None:
                assert proc.stderr is not None
                raise RuntimeError(f"{stage} server exited: "
                                   f"{proc.stderr.read().decode()[-3000:]}")
            assert time.monotonic() < deadline, f"{stage} server did not come up"
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
