"""From the `cluster` group (`moerl.config.ClusterConfig`) to the SLURM job.

The resources each stage needs (nodes, GPUs, replicas) come from the `launcher`,
`rollout` and `rewards` groups; this group holds what depends on the cluster
(partitions, account, limits, the lines that prepare a node) and is turned into
`slurm.SlurmConfig` by `slurm_config`. The local launcher ignores it.
"""

from __future__ import annotations

import dataclasses
import sys

from moerl.config import ClusterConfig
from moerl.launchers.slurm import SlurmConfig
from moerl.launchers.stages import RunPlan


def slurm_config(
    cluster: ClusterConfig, job_name: str, startup_timeout_s: float, python: str | None
) -> SlurmConfig:
    """The SlurmConfig the sbatch script is rendered with."""
    partitions = {
        stage: part
        for stage, part in (("trainer", cluster.trainer_partition),
                            ("rollout", cluster.rollout_partition),
                            ("reward", cluster.reward_partition),
                            ("environment", cluster.reward_partition))  # CPU nodes too
        if part
    }  # fmt: skip
    torchrun = tuple(cluster.torchrun) or (python or sys.executable, "-m", "torch.distributed.run")
    return SlurmConfig(
        partitions=partitions, account=cluster.account, time=cluster.time,
        mem_per_cpu=cluster.mem_per_cpu, signal_seconds=cluster.signal_seconds,
        requeue=cluster.requeue, job_name=cluster.job_name or job_name,
        master_port=cluster.master_port, master_addr=cluster.master_addr,
        server_master_port=cluster.rollout_master_port,
        advertise_host=cluster.advertise_host, torchrun=torchrun, setup=tuple(cluster.setup),
        startup_timeout=max(int(startup_timeout_s), 1), grace=cluster.grace_s,
    )  # fmt: skip


def with_cluster_ports(plan: RunPlan, cluster: ClusterConfig) -> RunPlan:
    """The plan with the cluster's fixed server ports (free ports are a local-only idea)."""
    ports = {"rollout": cluster.rollout_port, "reward": cluster.reward_port,
             "environment": cluster.environment_port}
    stages = tuple(
        dataclasses.replace(s, port_base=ports[s.name]) if s.is_server and not s.port_base else s
        for s in plan.stages
    )
    return dataclasses.replace(plan, stages=stages)
