"""The stage protocol: how a run's processes find each other.

Every stage (trainer, rollout servers, reward servers) gets the same environment
from its launcher (the ENV_* names below). A server that is healthy writes
`host:port` to `<rendezvous_dir>/<stage>/<index>.addr` (`announce`); clients wait
for the number of endpoints they expect (`discover`) or read what is there
(`read_endpoints`). The file appears by rename, so a reader on a shared filesystem
sees either nothing or the whole address, never half of it.

This module belongs to no stage: servers, clients and launchers all import it,
and it imports nothing of moerl (nor torch), so a server pays nothing for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx

# Environment every stage process receives.
ENV_RENDEZVOUS = "MOERL_RENDEZVOUS_DIR"
ENV_STAGE = "MOERL_STAGE"
ENV_INDEX = "MOERL_STAGE_INDEX"
ENV_HOST = "MOERL_HOST"
ENV_PORT = "MOERL_PORT"

# A trainer that checkpointed on SIGUSR1/SIGTERM before the time limit exits with
# this code to ask for a requeue (RELIABILITY.md #22); the SLURM script acts on it.
REQUEUE_EXIT_CODE = 85
# torchrun turns a rank's exit code into 1, so a rank also leaves this file in the
# rendezvous directory; the SLURM script requeues when it finds it.
REQUEUE_MARKER = "requeue"


def _stage_dir(rendezvous_dir: Path, stage: str) -> Path:
    return Path(rendezvous_dir) / stage


def announce(rendezvous_dir: Path | str, stage: str, index: int, host: str, port: int) -> Path:
    """Publish `host:port` of replica `index` of `stage`; atomic (tmp + fsync + rename)."""
    directory = _stage_dir(Path(rendezvous_dir), stage)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{index}.addr"
    # A dot-name that `discover` ignores; the pid keeps two writers apart.
    tmp = directory / f".{index}.addr.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(f"{host}:{port}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def announce_from_env(host: str, port: int) -> Path | None:
    """`announce` with the stage, index and directory the launcher passed in.

    For servers: call once healthy. Returns None (does nothing) when not started
    by a launcher.
    """
    rendezvous = os.environ.get(ENV_RENDEZVOUS)
    stage = os.environ.get(ENV_STAGE)
    if not rendezvous or not stage:
        return None
    return announce(rendezvous, stage, int(os.environ.get(ENV_INDEX, "0")), host, port)


def request_requeue() -> int:
    """Call after the pre-time-limit checkpoint; exit with the code it returns."""
    rendezvous = os.environ.get(ENV_RENDEZVOUS)
    if rendezvous:
        Path(rendezvous, REQUEUE_MARKER).touch()
    return REQUEUE_EXIT_CODE


def read_endpoints(rendezvous_dir: Path | str, stage: str) -> list[str]:
    """Endpoints announced so far, in replica order."""
    directory = _stage_dir(Path(rendezvous_dir), stage)
    if not directory.is_dir():
        return []
    found: list[tuple[int, str]] = []
    for path in directory.glob("*.addr"):
        if path.name.startswith(".") or not path.stem.isdigit():
            continue
        text = path.read_text().strip()
        if text:
            found.append((int(path.stem), text))
    return [addr for _, addr in sorted(found)]


def server_urls(rendezvous_dir: Path | str, stage: str) -> list[str]:
    """The `http://host:port` of every replica of `stage` announced so far, in rank order:
    how every client (rollout, reward, environment) finds its servers."""
    return [f"http://{address}" for address in read_endpoints(rendezvous_dir, stage)]


def discover(
    rendezvous_dir: Path | str,
    stage: str,
    expected: int,
    timeout: float,
    *,
    poll: float = 0.1,
    check: Callable[[], None] | None = None,
) -> list[str]:
    """Wait until `expected` replicas of `stage` have announced; their `host:port`s.

    `check` is called on every poll so a caller can abort early (e.g. raise when
    the server process it is waiting for has died).
    """
    deadline = time.monotonic() + timeout
    while True:
        endpoints = read_endpoints(rendezvous_dir, stage)
        if len(endpoints) >= expected:
            return endpoints[:expected]
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{stage}: {len(endpoints)} of {expected} endpoints announced in "
                f"{_stage_dir(Path(rendezvous_dir), stage)} after {timeout:.0f} s"
            )
        time.sleep(poll)


def wait_healthy(
    url: str,
    timeout: float,
    *,
    path: str = "/health",
    poll: float = 0.2,
    check: Callable[[], None] | None = None,
) -> None:
    """Poll `url + path` until it answers 200; TimeoutError with the last error."""
    base = url if "://" in url else f"http://{url}"
    target = base.rstrip("/") + path
    deadline = time.monotonic() + timeout
    last = "no answer"
    with httpx.Client(timeout=min(5.0, max(timeout, 0.1)), trust_env=False) as client:
        while True:
            try:
                response = client.get(target)
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as err:
                last = f"{type(err).__name__}: {err}"
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} not healthy after {timeout:.0f} s ({last})")
            time.sleep(poll)
