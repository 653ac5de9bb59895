"""What a run starts, and how its processes find each other.

A run is three kinds of processes (DESIGN.md): the trainer, rollout servers and
reward servers. `StageSpec` says what one kind runs and with what resources;
`RunPlan` groups them with the two shared directories. The same plan is placed on
one machine by `local.LocalLauncher` and on a cluster by `slurm.render_sbatch`.

Rendezvous: a server that is healthy writes `host:port` to
`<rendezvous_dir>/<stage>/<index>.addr` (`announce`); clients wait for the number
of endpoints they expect (`discover`). The file appears by rename, so a reader on a
shared filesystem sees either nothing or the whole address, never half of it.

A stage's command may contain `{host}`, `{port}` and `{index}`; the launcher fills
them in per replica, and also passes them as environment variables (see ENV_*).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

StageName = Literal["trainer", "rollout", "reward"]
STAGE_NAMES: tuple[StageName, ...] = ("trainer", "rollout", "reward")

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

PLACEHOLDERS = ("{host}", "{port}", "{index}")


@dataclass(frozen=True)
class StageSpec:
    """One kind of process in a run."""

    name: StageName
    command: tuple[str, ...]
    """argv of one replica (for the trainer: of one rank, started by torchrun)."""
    replicas: int = 1
    """server processes of this stage; the trainer is always one torchrun job."""
    nodes: int = 1
    """nodes this stage gets on a cluster (ignored locally)."""
    gpus_per_node: int = 0
    cpus: int = 1
    """CPUs per replica (for the trainer: per node)."""
    env: Mapping[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    port_base: int = 0
    """replica i listens on port_base + i; 0 picks free ports (local only)."""
    ranks_per_node: int = 1
    """trainer ranks per node (torchrun --nproc-per-node)."""
    torchrun: bool = True
    """start the trainer under torchrun; False runs the command once per node."""

    def __post_init__(self) -> None:
        if self.name not in STAGE_NAMES:
            raise ValueError(f"stage name {self.name!r}: expected one of {STAGE_NAMES}")
        if not self.command:
            raise ValueError(f"stage {self.name}: command is empty")
        for attr in ("replicas", "nodes", "cpus", "ranks_per_node"):
            if getattr(self, attr) < 1:
                raise ValueError(f"stage {self.name}: {attr} must be >= 1")
        if self.gpus_per_node < 0 or self.port_base < 0:
            raise ValueError(f"stage {self.name}: gpus_per_node and port_base must be >= 0")
        if self.name == "trainer" and self.replicas != 1:
            raise ValueError("stage trainer: replicas must be 1 (scale it with nodes)")
        if not self.health_path.startswith("/"):
            raise ValueError(f"stage {self.name}: health_path must start with '/'")

    @property
    def is_server(self) -> bool:
        return self.name != "trainer"

    def argv(self, host: str, port: int, index: int) -> list[str]:
        """The command with its placeholders filled in for one replica."""
        values = {"{host}": host, "{port}": str(port), "{index}": str(index)}
        out = []
        for arg in self.command:
            for key, value in values.items():
                arg = arg.replace(key, value)
            out.append(arg)
        return out


@dataclass(frozen=True)
class RunPlan:
    """The stages of one run and the two directories they share."""

    stages: tuple[StageSpec, ...]
    rendezvous_dir: Path
    log_dir: Path

    def __post_init__(self) -> None:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"each stage may appear once, got {names}")
        if "trainer" not in names:
            raise ValueError("a run needs a trainer stage")

    @property
    def trainer(self) -> StageSpec:
        return next(s for s in self.stages if s.name == "trainer")

    @property
    def servers(self) -> tuple[StageSpec, ...]:
        """Server stages in start order: rewards first, as rollouts may need them."""
        order = {"reward": 0, "rollout": 1}
        return tuple(sorted((s for s in self.stages if s.is_server), key=lambda s: order[s.name]))


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
