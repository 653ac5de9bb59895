"""`moerl train launcher=slurm`: the run as one SLURM heterogeneous job.

`--dry-run` prints the sbatch script; otherwise it is submitted and this process
waits for the job (`sbatch --wait`) and returns its exit code. Ctrl-C cancels
the job: a run whose launcher is gone would otherwise hold its nodes unseen.
"""

from __future__ import annotations

import subprocess

from rich.console import Console

from moerl.config import RunConfig
from moerl.launchers import slurm
from moerl.launchers.cluster import slurm_config, with_cluster_ports
from moerl.launchers.stages import RunPlan


def slurm_job(plan: RunPlan, cfg: RunConfig, job_name: str) -> tuple[RunPlan, slurm.SlurmConfig]:
    """The plan as placed on the cluster (fixed ports) and the options of its job."""
    slurm_cfg = slurm_config(cfg.cluster, job_name, cfg.launcher.startup_timeout_s,
                             cfg.launcher.python)
    return with_cluster_ports(plan, cfg.cluster), slurm_cfg


def run_on_slurm(
    plan: RunPlan, cfg: RunConfig, job_name: str, dry_run: bool, console: Console
) -> int:
    """Print (dry run) or submit the job and wait; the job's exit code."""
    plan, slurm_cfg = slurm_job(plan, cfg, job_name)
    if dry_run:
        print(slurm.render_sbatch(plan, slurm_cfg))
        return 0
    job: list[int] = []

    def submitted(job_id: int) -> None:
        job.append(job_id)
        console.print(f"submitted SLURM job {job_id}; batch log "
                      f"{plan.log_dir}/slurm-{job_id}.out", markup=False)

    try:
        done = slurm.launch(plan, slurm_cfg, wait=True, on_submit=submitted)
    except slurm.SlurmError as err:
        console.print(str(err), style="red", markup=False)
        return 1
    except KeyboardInterrupt:
        if job:
            subprocess.run(["scancel", str(job[0])], check=False)
            console.print(f"cancelled SLURM job {job[0]}", markup=False)
        return 130
    code = done.exit_code or 0
    if code != 0:
        console.print(f"SLURM job {done.job_id} exited with {code}; logs in {plan.log_dir}",
                      style="red", markup=False)
    return code
