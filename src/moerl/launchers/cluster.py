"""From the `cluster` group (`moerl.config.ClusterConfig`) to the SLURM job.

The resources each stage needs (nodes, GPUs, replicas) come from the `launcher`,
`rollout` and `rewards` groups; this group holds what depends on the cluster
(partitions, account, limits, the lines that prepare a node) and reaches the batch
script unchanged, inside `slurm.SlurmConfig` (`slurm_config`). The local launcher
ignores it.
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
    """The SlurmConfig the sbatch script is rendered with: the group itself, and the job
    name, torchrun command and start-up timeout its defaults leave to the run."""
    torchrun = tuple(cluster.torchrun) or (python or sys.executable, "-m", "torch.distributed.run")
    return SlurmConfig(cluster, job_name=cluster.job_name or job_name, torchrun=torchrun,
                       startup_timeout=max(int(startup_timeout_s), 1))


def with_cluster_ports(plan: RunPlan, cluster: ClusterConfig) -> RunPlan:
    """The plan with the cluster's fixed server ports (free ports are a local-only idea)."""
    ports = {"rollout": cluster.rollout_port, "reward": cluster.reward_port,
             "environment": cluster.environment_port}
    stages = tuple(
        dataclasses.replace(s, port_base=ports[s.name]) if s.is_server and not s.port_base else s
        for s in plan.stages
    )
    return dataclasses.replace(plan, stages=stages)
