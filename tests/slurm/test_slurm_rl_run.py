"""The tiny demo as one heterogeneous job on the local SLURM cluster (conftest.py).

`moerl train launcher=slurm` renders and submits the real script; the trainer,
rollout server and reward server run as three job steps on the fake nodes, find
each other through the rendezvous directory, and the run completes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm

SHORT_RUN = [
    "rl.steps=2", "sft.steps=5", "rl.prompts_per_step=4", "rl.eval_interval=0",
    "data.eval_size=8",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster_overrides() -> list[str]:
    # Fixed ports on SLURM (no free-port search there); pick ones free right now,
    # since all fake nodes share this host's network namespace.
    return [
        "launcher=slurm", "cluster=local", "cluster.trainer_partition=gpu",
        "cluster.rollout_partition=gpu", "cluster.reward_partition=cpu",
        f"cluster.rollout_port={_free_port()}", f"cluster.reward_port={_free_port()}",
        f"cluster.master_port={_free_port()}", "cluster.grace_s=5",
        "launcher.startup_timeout_s=300",
    ]  # fmt: skip


def _moerl(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moerl.launchers.cli", *args], capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False,
    )  # fmt: skip


def test_dry_run_prints_the_script(tmp_path: Path) -> None:
    done = _moerl("train", "+experiment=demo", *_cluster_overrides(),
                  f"run_dir={tmp_path / 'run'}", "--dry-run", timeout=120)
    assert done.returncode == 0, done.stderr
    script = done.stdout
    assert script.startswith("#!/bin/bash") and script.count("#SBATCH hetjob") == 2
    assert "#SBATCH --partition=cpu" in script and "--signal=B:USR1@120" in script
    # absolute paths only: the steps run wherever the nodes mount the shared filesystem
    assert f"--arch-file {tmp_path / 'run' / 'arch.json'}" in script
    assert f"export MOERL_CONFIG_DIR={Path(__file__).resolve().parents[2] / 'configs'}" in script
    assert f"exec {sys.executable} -m moerl.launchers.cli serve reward" in script
    assert not list((tmp_path / "run").glob("logs/slurm-*.out")), "a dry run submits nothing"


@pytest.mark.timeout(420)
def test_tiny_demo_completes_as_het_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = _moerl("train", "+experiment=demo", *_cluster_overrides(), *SHORT_RUN,
                  f"run_dir={run}", timeout=400)
    batch_logs = list((run / "logs").glob("slurm-*.out"))
    assert len(batch_logs) == 1, done.stderr
    batch = batch_logs[0].read_text(errors="replace")
    assert done.returncode == 0, f"{done.stderr[-3000:]}\n--- batch log:\n{batch[-3000:]}"
    job_id = int(batch_logs[0].stem.split("-", 1)[1])
    assert f"submitted SLURM job {job_id}" in done.stderr
    assert "moerl: trainer exit code 0" in batch

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [0, 1]
    evals = [r for r in rows if "eval/pass_rate" in r]
    assert len(evals) == 2 and {e["step"] for e in evals} == {0, 2}

    # one step per stage, each with its own log, each having done its part
    logs = {name: list((run / "logs").glob(f"{name}-*.log")) for name in
            ("trainer", "rollout", "reward")}
    assert all(len(found) == 1 for found in logs.values()), logs
    trainer_log = logs["trainer"][0].read_text(errors="replace")
    assert "SFT: loss" in trainer_log and "held-out evaluation" in trainer_log
    steps = slurm_cluster.run("scontrol", "show", "job", str(job_id), check=False).stdout
    assert "JobState=COMPLETED" in steps
    assert sorted(p.name for p in (run / "rendezvous" / str(job_id)).iterdir()) == [
        "reward", "rollout"
    ]
