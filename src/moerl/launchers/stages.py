"""What a run starts: its stages and their resources.

A run is three kinds of processes (DESIGN.md): the trainer, rollout servers and
reward servers. `StageSpec` says what one kind runs and with what resources;
`RunPlan` groups them with the two shared directories. The same plan is placed on
one machine by `local.LocalLauncher`, on a cluster by `slurm.render_sbatch`, and as
a nemo-run experiment by `nemo`; what each replica is started with (argv, environment,
port, torchrun, readiness) is derived once, in `stage_render`.

How the processes find each other once started is `moerl.rendezvous`.

A stage's command may contain `{host}`, `{port}` and `{index}`; the launcher fills
them in per replica, and also passes them as environment variables (`moerl.rendezvous.ENV_*`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from moerl.rendezvous import ENV_HOST, ENV_INDEX, ENV_PORT, ENV_RENDEZVOUS, ENV_STAGE

StageName = Literal["trainer", "rollout", "reward", "environment"]
STAGE_NAMES: tuple[StageName, ...] = ("trainer", "rollout", "reward", "environment")

PLACEHOLDERS = ("{host}", "{port}", "{index}")
LAUNCHER_VARS = (ENV_RENDEZVOUS, ENV_STAGE, ENV_INDEX, ENV_HOST, ENV_PORT)
"""what the launcher sets for each replica; a stage's env may not set them."""


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
    """added to each replica's environment; the launcher's own variables (LAUNCHER_VARS)
    are not the stage's to set."""
    health_path: str = "/health"
    port_base: int = 0
    """replica i listens on port_base + i; 0 picks free ports (local only)."""
    binds_any_port: bool = False
    """the server takes port 0, binds a free port itself and announces the one it got:
    locally it is given 0, so no other process can take the port between its choice and
    the bind (two runs on one machine collided that way)."""
    ranks_per_node: int = 1
    """ranks per node under torchrun (--nproc-per-node): the trainer's; a server with
    more than one runs each replica under torchrun."""
    torchrun: bool = True
    """start the trainer under torchrun; False runs the command once per node."""
    span: int = 1
    """nodes one server replica spans (a rollout engine larger than a node): its
    torchrun ranks are span x ranks_per_node; its first rank serves."""

    def __post_init__(self) -> None:
        if self.name not in STAGE_NAMES:
            raise ValueError(f"stage name {self.name!r}: expected one of {STAGE_NAMES}")
        if not self.command:
            raise ValueError(f"stage {self.name}: command is empty")
        for attr in ("replicas", "nodes", "cpus", "ranks_per_node", "span"):
            if getattr(self, attr) < 1:
                raise ValueError(f"stage {self.name}: {attr} must be >= 1")
        if self.gpus_per_node < 0 or self.port_base < 0:
            raise ValueError(f"stage {self.name}: gpus_per_node and port_base must be >= 0")
        if self.name == "trainer" and self.replicas != 1:
            raise ValueError("stage trainer: replicas must be 1 (scale it with nodes)")
        if self.span > 1 and (self.name == "trainer" or self.nodes != self.replicas * self.span):
            raise ValueError(
                f"stage {self.name}: a replica spanning {self.span} nodes needs nodes = "
                f"replicas x span = {self.replicas * self.span}, got {self.nodes}")
        if taken := sorted(set(self.env) & set(LAUNCHER_VARS)):
            raise ValueError(f"stage {self.name}: env may not set {taken}: the launcher "
                             "sets them for each replica")
        if not self.health_path.startswith("/"):
            raise ValueError(f"stage {self.name}: health_path must start with '/'")

    @property
    def is_server(self) -> bool:
        return self.name != "trainer"

    @property
    def server_torchrun(self) -> bool:
        """a server whose replicas each run as ranks under torchrun."""
        return self.is_server and (self.ranks_per_node > 1 or self.span > 1)

    def argv(self, host: str, port: int | str, index: int | str) -> list[str]:
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
        order = {"reward": 0, "environment": 1, "rollout": 2}
        return tuple(sorted((s for s in self.stages if s.is_server), key=lambda s: order[s.name]))
