"""What one replica of a stage is started with, derived once for every launcher.

A `StageSpec` says what a stage runs; from it and a replica's place (`Replica`:
host, port, index) this module derives what the replica's process gets: its argv
with the placeholders filled (`replica_argv`); the environment beyond the
launcher's own (`replica_env`: `shared_env`, the stage's env and the rendezvous
directory, then the replica's placement, `moerl.rendezvous.ENV_*`); its port
(`local_port` on one machine, `fixed_port` where ports are fixed in advance);
whether torchrun starts its ranks and with which options (`under_torchrun`,
`torchrun_argv`, `local_command`); and when the stage counts as ready (`readiness`).

`local.LocalLauncher` renders these as values; `slurm.render_sbatch` (and
`nemo.slurm_scripts`, its steps) as shell text, where the host, port and index are
shell expressions (`$(hostname)`, `$SLURM_PROCID`) and the command refers to the
exported variables (`shell_words`); `nemo.local_scripts` as shell text with values.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from moerl.config import ClusterConfig
from moerl.launchers.stages import PLACEHOLDERS, StageSpec
from moerl.rendezvous import ENV_HOST, ENV_INDEX, ENV_PORT, ENV_RENDEZVOUS, ENV_STAGE

DEFAULT_PORTS = {name: getattr(ClusterConfig, f"{name}_port")
                 for name in ("rollout", "reward", "environment")}
"""first ports of the servers without a port_base where ports are fixed in advance:
the cluster config's defaults."""
PLACEHOLDER_VARS = dict(zip(PLACEHOLDERS, (ENV_HOST, ENV_PORT, ENV_INDEX), strict=True))
"""each command placeholder and the variable that carries the same value."""
LOCAL_TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
_PLACEHOLDER = re.compile("(" + "|".join(re.escape(p) for p in PLACEHOLDER_VARS) + ")")


@dataclass(frozen=True)
class Replica:
    """Where one replica runs: values on this machine, or shell expressions in a
    script (`"$(hostname)"`, `$((8000 + SLURM_PROCID))`, `$SLURM_PROCID`)."""

    host: str
    port: str
    index: str


@dataclass(frozen=True)
class Readiness:
    """When a server stage is up: `replicas` announcements in the rendezvous directory
    under `stage`, each replica answering `health_path` (it announces once it does)."""

    stage: str
    replicas: int
    health_path: str


def readiness(stage: StageSpec) -> Readiness:
    return Readiness(stage.name, stage.replicas, stage.health_path)


def count_announced(stage_dir: str) -> str:
    """Shell that prints how many replicas have announced themselves in `stage_dir` (a
    shell word): the finished `<index>.addr` files, not the temporary ones."""
    return f"find {stage_dir} -maxdepth 1 -name '[0-9]*.addr' 2>/dev/null | wc -l"


def fixed_port(stage: StageSpec, index: str) -> str:
    """The port of replica `index` where ports are fixed in advance (a batch script,
    nemo-run): port_base (else DEFAULT_PORTS) + index; the trainer serves none: 0.
    An index `$NAME` is a shell variable, the port then a shell arithmetic expression."""
    if not stage.is_server:
        return "0"
    base = stage.port_base or DEFAULT_PORTS[stage.name]
    if index.startswith("$"):
        return f"$(({base} + {index[1:]}))"
    return str(base + int(index))


def local_port(stage: StageSpec, index: int) -> int | None:
    """The port of replica `index` on this machine: port_base + index; without a
    port_base, 0 for a server that binds a free port itself and None for one the
    launcher picks a free port for; the trainer serves none: 0."""
    if not stage.is_server:
        return 0
    if stage.port_base:
        return stage.port_base + index
    return 0 if stage.binds_any_port else None


def placement_env(stage: StageSpec, replica: Replica) -> dict[str, str]:
    """The variables that place one replica: its stage, index, port and host."""
    return {ENV_STAGE: stage.name, ENV_INDEX: replica.index, ENV_PORT: replica.port,
            ENV_HOST: replica.host}


def shared_env(stage: StageSpec, rendezvous_dir: str) -> dict[str, str]:
    """What every replica of the stage gets: the stage's env and the rendezvous directory."""
    return {**stage.env, ENV_RENDEZVOUS: rendezvous_dir}


def replica_env(stage: StageSpec, replica: Replica, rendezvous_dir: str) -> dict[str, str]:
    """What one replica's environment gets beyond the launcher's own: `shared_env` and
    its placement (a stage's env may not set the placement's variables)."""
    return {**shared_env(stage, rendezvous_dir), **placement_env(stage, replica)}


def replica_argv(stage: StageSpec, replica: Replica) -> list[str]:
    """The stage's command for one replica, each placeholder filled with the value of
    its variable in `placement_env`."""
    env = placement_env(stage, replica)
    return stage.argv(env[ENV_HOST], env[ENV_PORT], env[ENV_INDEX])


def shell_words(stage: StageSpec) -> str:
    """The stage's command as shell words, each placeholder a reference to its variable
    (`"${MOERL_PORT}"`): what a script runs once it has exported `placement_env`."""
    return " ".join(_shell_word(arg) for arg in stage.command)


def _shell_word(arg: str) -> str:
    out = "".join(
        f'"${{{PLACEHOLDER_VARS[p]}}}"' if p in PLACEHOLDER_VARS else shlex.quote(p)
        for p in _PLACEHOLDER.split(arg)
        if p
    )
    return out or "''"


def under_torchrun(stage: StageSpec) -> bool:
    """Whether torchrun starts the replica's ranks: the trainer's (unless torchrun=False)
    and those of a server with more than one rank."""
    return stage.server_torchrun or (stage.name == "trainer" and stage.torchrun)


def torchrun_argv(
    stage: StageSpec, launcher: Sequence[str], *, node_rank: str | None = None,
    master: tuple[str, str] | None = None, extra: Sequence[str] = (),
) -> list[str]:
    """torchrun's words before the command: without `master`, a standalone rendezvous on
    one node; with it, node `node_rank` of the replica's nodes (a server's span, the
    trainer's nodes) meeting at master (address, port). `--nproc-per-node` is the stage's
    ranks_per_node; `extra` goes last, before `--no-python`."""
    words = [*launcher]
    if master is None:
        words += ["--standalone", "--nnodes=1"]
    else:
        nodes = stage.span if stage.is_server else stage.nodes
        words += [f"--nnodes={nodes}", f"--node-rank={node_rank}"]
    words.append(f"--nproc-per-node={stage.ranks_per_node}")
    if master is not None:
        words += [f"--master-addr={master[0]}", f"--master-port={master[1]}"]
    return [*words, *extra, "--no-python"]


def local_command(stage: StageSpec, replica: Replica) -> list[str]:
    """The full argv of one replica on this machine: under a standalone torchrun where
    its ranks need one. A replica spanning nodes cannot run on one machine."""
    if stage.span > 1:
        raise ValueError(
            f"stage {stage.name}: a replica spanning {stage.span} nodes needs a cluster "
            "(launcher=slurm); on one machine each server runs on this one")
    argv = replica_argv(stage, replica)
    if not under_torchrun(stage):
        return argv
    return [*torchrun_argv(stage, LOCAL_TORCHRUN), *argv]
