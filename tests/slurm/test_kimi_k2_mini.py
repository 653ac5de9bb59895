"""Kimi-K2's recipe in miniature (configs/experiment/kimi_k2_mini.yaml) on the local
SLURM cluster (conftest.py), rendered by the code that renders the 1T scripts.

One heterogeneous job: the trainer on two fake GPU nodes x 4 ranks (TP, PP, EP and DP
all 2), one rollout engine of 2 ranks (EP 2) on a third, reward and environment
servers on the CPU node; agent tasks, every sandbox on the environment server, each
new policy version streamed to the engine's ranks in memory. Sent USR1 as
`--signal=B:USR1@T` would before the time limit, the trainer checkpoints after its
step, the job requeues itself, and the next attempt resumes and finishes 3 RL steps.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from job_watch import RunWatch, metric_rows, trained_steps

from moerl.checkpoint.store import complete_checkpoints, read_latest, step_name, step_of
from moerl.config import ClusterConfig
from moerl.launchers import recipes, slurm
from moerl.ports import free_port
from moerl.rendezvous import read_endpoints

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm

STEPS = 3
# Short episodes on two of the shipped agent tasks; checkpoints only at the end and on
# a stop signal, so the one found after USR1 is the signal's.
RUN = [
    f"rl.steps={STEPS}", "rl.agent.tasks=[files-create-greeting,logs-count-errors]",
    "rl.prompts_per_step=1", "rl.group_size=2", "rl.dynamic_sampling=false",
    "rl.eval_interval=0", "rl.agent.max_turns=2", "rl.agent.max_new_tokens=24",
    "rl.agent.max_observation_tokens=128", "rl.agent.max_episode_tokens=900",
    "logger.plot=false", "checkpoint.save_interval=0", "checkpoint.keep_last=0",
]  # fmt: skip


def local_site() -> recipes.Site:
    """This machine's cluster: partitions gpu/gpu/cpu as on the H100 site, loopback
    addresses (fake node names do not resolve), ports free right now (all fake nodes
    share this host's network), the checkout and Python this test runs from."""
    cluster = ClusterConfig(
        trainer_partition="gpu", rollout_partition="gpu", reward_partition="cpu",
        time="01:00:00", signal_seconds=120, rollout_port=free_port(),
        reward_port=free_port(), environment_port=free_port(), master_port=free_port(),
        rollout_master_port=free_port(), master_addr="127.0.0.1", advertise_host="127.0.0.1",
        grace_s=5,
    )  # fmt: skip
    return recipes.Site(recipes.REPO, sys.executable, "local", cluster, cpus_per_gpu=2,
                        server_cpus=2)


@pytest.mark.timeout(1500)
def test_kimi_k2_mini_runs_requeues_and_resumes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    script = recipes.render_recipe("kimi_k2_mini", local_site(), run, RUN)
    (run / "logs").mkdir(parents=True)
    watch = RunWatch(run)
    started = time.monotonic()
    try:
        watch.job = slurm.submit(script, env=slurm_cluster.env).job_id
        _run_signal_resume(watch, slurm_cluster)
    finally:
        if watch.job is not None:
            slurm_cluster.run("scancel", str(watch.job), check=False)
        print(f"\nKimi-K2 mini: 3 RL steps, USR1, requeue, resume: "
              f"{time.monotonic() - started:.0f} s")


def _run_signal_resume(watch: RunWatch, cluster: SlurmCluster) -> None:
    run, ckpts, job = watch.run, watch.run / "checkpoints", watch.job
    assert job is not None
    watch.until(lambda: bool(trained_steps(run)), 900, "RL step finished", cluster)
    assert not complete_checkpoints(ckpts), "a checkpoint before any signal was sent"
    _check_servers(run / "rendezvous" / str(job))
    cluster.run("scancel", "--batch", "--signal=USR1", str(job))

    watch.until(lambda: cluster.job_field(job, "Restarts") == "1", 300, "requeue", cluster)
    saved = read_latest(ckpts)
    diag = watch.diagnostics(cluster)
    assert saved is not None and complete_checkpoints(ckpts) == [saved], diag
    step = step_of(saved)
    assert step is not None and 1 <= step < STEPS, f"nothing left to resume\n{diag}"

    finished = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
    watch.until(lambda: cluster.job_field(job, "JobState") in finished, 900, "job end", cluster)
    diag = watch.diagnostics(cluster)
    assert cluster.job_field(job, "JobState") == "COMPLETED", diag
    batch = watch.batch_log()
    assert batch is not None, diag
    codes = re.findall(r"moerl: trainer exit code (\d+)", batch.read_text(errors="replace"))
    assert len(codes) == 2 and codes[1] == "0", f"{codes}\n{diag}"
    trainer = watch.trainer_log()
    assert trainer is not None and f"resumed from {saved} at step {step}" in trainer.read_text(
        errors="replace"), diag
    # Each step once, in order, the resumed attempt going on from the saved step.
    assert trained_steps(run) == list(range(STEPS)), diag
    assert read_latest(ckpts) == ckpts / step_name(STEPS), diag
    _check_weights_streamed(run, step)


def _check_servers(rendezvous: Path) -> None:
    """After the first step: the engine the trainer streams to runs on two ranks
    (torchrun across its node), and the step's episodes ran on the environment server
    (one session each: a group of 2)."""
    (rollout,) = read_endpoints(rendezvous, "rollout")
    health = httpx.get(f"http://{rollout.removeprefix('http://')}/health", timeout=30).json()
    assert health["ranks"] == 2, health
    (environment,) = read_endpoints(rendezvous, "environment")
    health = httpx.get(f"http://{environment.removeprefix('http://')}/health",
                       timeout=30).json()
    assert health["opened"] >= 2 and health["recreated"] == 0, health


def _check_weights_streamed(run: Path, resumed_at: int) -> None:
    """Every version after each attempt's first went to the engine in memory: the
    count of streamed versions rises by one a step, starting again at the resume."""
    rows = [r for r in metric_rows(run) if "train/loss" in r]
    streamed = [int(r["weights/streamed"]) for r in rows]
    expected = [s + 1 for s in range(resumed_at)] + [s - resumed_at + 1
                                                     for s in range(resumed_at, STEPS)]
    assert streamed == expected, streamed
