"""Rollout servers for distributed tests: published weights of the tiny model, and
`moerl serve rollout` started as users start it (under torchrun for several ranks),
found through its rendezvous announcement and stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from moerl.rendezvous import discover, wait_healthy
from moerl.rollout.client import RolloutClient

sys.path.insert(0, str(Path(__file__).parent))
from worker_launch import SRC, worker_env


def publish(model_seed: int, directory: Path) -> Path:
    """The tiny model from `model_seed`, saved as the trainer publishes weights."""
    code = (
        "import sys; from moerl.models.arch import TINY; from moerl.models.build import "
        "build_model; from moerl.models.weights import save_weights; from moerl.parallel."
        "groups import init_parallel; from moerl.parallel.layout import ParallelLayout; "
        f"init_parallel(ParallelLayout(), seed={model_seed}); "
        "save_weights(build_model(TINY, ParallelLayout()), sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", code, str(directory)], env=worker_env(), check=True,
                   capture_output=True, timeout=300)
    return directory


@contextmanager
def rollout_server(tmp: Path, ranks: int, flags: list[str], weights: Path,
                   pids: list[int] | None = None) -> Iterator[RolloutClient]:
    """A server on `ranks` ranks from `weights`; SIGTERM at the end must stop every rank.
    `pids` receives the pid of the server's launcher (torchrun, or the server itself)."""
    rendezvous = tmp / f"rendezvous-{len(list(tmp.iterdir()))}"
    serve = ["-m", "moerl.launchers.cli", "serve", "rollout", "--port", "0", "--kv-cache-gb",
             "0.05", "--weights", str(weights), "--rendezvous-dir", str(rendezvous), *flags]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={ranks}"] if ranks > 1 else [sys.executable])
    env = {**worker_env(), "PYTHONPATH": str(SRC)}
    log = open(tmp / f"{rendezvous.name}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([*launcher, *serve], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    if pids is not None:
        pids.append(proc.pid)

    def alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n"
                               + (tmp / f"{rendezvous.name}.log").read_text()[-3000:])

    try:
        (url,) = discover(rendezvous, "rollout", 1, timeout=240, check=alive)
        wait_healthy(url, timeout=60, check=alive)
        client = RolloutClient([f"http://{url}"])
        yield client
        client.close()
        proc.send_signal(signal.SIGTERM)
        # Every rank ends on SIGTERM (torchrun passes it on, then exits 1 itself).
        code = proc.wait(timeout=60)
        expected = (1,) if ranks > 1 else (0, -signal.SIGTERM)
        assert code in expected, (tmp / f"{rendezvous.name}.log").read_text()[-3000:]
        with pytest.raises(ProcessLookupError):  # no rank outlived the server
            os.killpg(proc.pid, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


