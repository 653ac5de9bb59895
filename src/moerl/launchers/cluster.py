"""The `cluster` group: where a SLURM run goes and how the job is asked for.

The resources each stage needs (nodes, GPUs, replicas) come from the `launcher`,
`rollout` and `rewards` groups; this group holds what depends on the cluster
(partitions, account, limits, the lines that prepare a node) and is turned into
`slurm.SlurmConfig` by `slurm_config`. The local launcher ignores it.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

from moerl.launchers.slurm import SlurmConfig
from moerl.launchers.stages import RunPlan


@dataclass
class ClusterConfig:
    """The `cluster` group (SLURM only)."""

    trainer_partition: str | None = None
    """None: the cluster's default partition (likewise below)."""
    rollout_partition: str | None = None
    reward_partition: str | None = None
    account: str | None = None
    time: str = "04:00:00"
    mem_per_cpu: str | None = None
    """e.g. "4G" for every component; None: the cluster's default."""
    signal_seconds: int = 600
    """USR1 this long before the time limit (checkpoint, then requeue); 0: none."""
    requeue: bool = True
    job_name: str | None = None
    """None: the name of the run directory."""
    rollout_port: int = 8000
    """replica i of a stage listens on port + i; fixed, as servers on one node share it."""
    reward_port: int = 8100
    master_port: int = 29500
    master_addr: str | None = None
    """None: the first trainer node by name; set it where node names do not resolve."""
    advertise_host: str | None = None
    """address servers announce; None: each node's hostname."""
    torchrun: list[str] = field(default_factory=list)
    """the torchrun command; empty: `<launcher.python> -m torch.distributed.run`."""
    setup: list[str] = field(default_factory=list)
    """shell lines run in the batch script before any step (module load, ...)."""
    grace_s: int = 30
    """seconds between SIGTERM and SIGKILL when the job's steps are stopped."""

    def __post_init__(self) -> None:
        for name in ("rollout_port", "reward_port", "master_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"cluster.{name}: expected a port in 1..65535")
        try:  # SlurmConfig's own checks, at start-up rather than at submission
            SlurmConfig(mem_per_cpu=self.mem_per_cpu, signal_seconds=self.signal_seconds,
                        grace=self.grace_s)
        except ValueError as err:
            raise ValueError(f"cluster: {err}") from None


def slurm_config(
    cluster: ClusterConfig, job_name: str, startup_timeout_s: float, python: str | None
) -> SlurmConfig:
    """The SlurmConfig the sbatch script is rendered with."""
    partitions = {
        stage: part
        for stage, part in (("trainer", cluster.trainer_partition),
                            ("rollout", cluster.rollout_partition),
                            ("reward", cluster.reward_partition))
        if part
    }  # fmt: skip
    torchrun = tuple(cluster.torchrun) or (python or sys.executable, "-m", "torch.distributed.run")
    return SlurmConfig(
        partitions=partitions, account=cluster.account, time=cluster.time,
        mem_per_cpu=cluster.mem_per_cpu, signal_seconds=cluster.signal_seconds,
        requeue=cluster.requeue, job_name=cluster.job_name or job_name,
        master_port=cluster.master_port, master_addr=cluster.master_addr,
        advertise_host=cluster.advertise_host, torchrun=torchrun, setup=tuple(cluster.setup),
        startup_timeout=max(int(startup_timeout_s), 1), grace=cluster.grace_s,
    )  # fmt: skip


def with_cluster_ports(plan: RunPlan, cluster: ClusterConfig) -> RunPlan:
    """The plan with the cluster's fixed server ports (free ports are a local-only idea)."""
    ports = {"rollout": cluster.rollout_port, "reward": cluster.reward_port}
    stages = tuple(
        dataclasses.replace(s, port_base=ports[s.name]) if s.is_server and not s.port_base else s
        for s in plan.stages
    )
    return dataclasses.replace(plan, stages=stages)
