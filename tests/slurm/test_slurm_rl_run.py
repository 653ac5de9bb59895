"""The tiny demo as one heterogeneous job on the local SLURM cluster (conftest.py).

`moerl train launcher=slurm` renders and submits the real script; the trainer,
rollout server and reward server run as three job steps on the fake nodes, find
each other through the rendezvous directory, and the run completes. Sent USR1 the
way `--signal=B:USR1@T` does before the time limit, a real RL run checkpoints,
the job requeues itself, and the next attempt resumes from that checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from moerl.ports import free_port

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from job_watch import RunWatch, tail, trained_steps
from tiny_rl_data import comment_tasks

from moerl.checkpoint.store import complete_checkpoints, read_latest, step_name, step_of
from moerl.rendezvous import REQUEUE_EXIT_CODE

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm

SHORT_RUN = [
    "rl.steps=2", "sft.steps=5", "rl.prompts_per_step=4", "rl.eval_interval=0",
    "data.eval_size=8",
]  # fmt: skip


def _cluster_overrides() -> list[str]:
    # Fixed ports on SLURM (no free-port search there); pick ones free right now,
    # since all fake nodes share this host's network namespace.
    return [
        "launcher=slurm", "cluster=local", "cluster.trainer_partition=gpu",
        "cluster.rollout_partition=gpu", "cluster.reward_partition=cpu",
        f"cluster.rollout_port={free_port()}", f"cluster.reward_port={free_port()}",
        f"cluster.master_port={free_port()}", "cluster.grace_s=5",
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


# A real RL run whose every step trains quickly (as in tests/integration/test_rl_resume.py):
# twelve one-line tasks, short samples, a 2-step SFT warm-up, checkpoints only at
# the end and on a stop signal.
RESUME_STEPS = 4
RESUME_RUN = [
    f"rl.steps={RESUME_STEPS}", "sft.steps=2", "sft.global_batch=8", "sft.micro_batch=4",
    "rl.prompts_per_step=2", "rl.group_size=4", "rl.sampling.max_tokens=48",
    "rl.eval_interval=0", "logger.wandb_mode=disabled", "logger.plot=false",
    "checkpoint.save_interval=0", "checkpoint.keep_last=0",
]  # fmt: skip


@pytest.mark.timeout(1500)
def test_usr1_checkpoints_requeues_and_resumes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """USR1 to the batch shell (what `--signal=B:USR1@T` sends before the time limit)
    during a real RL run: the trainer finishes its step, writes a complete
    checkpoint, exits for requeue; the job requeues itself (Restarts=1), and the
    next attempt resumes from that checkpoint and completes the run."""
    run = tmp_path / "run"
    run.mkdir()
    out = tmp_path / "moerl-train.out"
    argv = [sys.executable, "-m", "moerl.launchers.cli", "train", "+experiment=demo",
            *_cluster_overrides(), *RESUME_RUN, *comment_tasks(tmp_path / "data"),
            f"run_dir={run}"]  # fmt: skip
    with open(out, "wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    watch = RunWatch(run, proc, out)
    started = time.monotonic()
    try:
        _signal_requeue_resume(watch, slurm_cluster)
    finally:
        if watch.job is not None:
            slurm_cluster.run("scancel", str(watch.job), check=False)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        print(f"\nUSR1 -> requeue -> resume under SLURM: {time.monotonic() - started:.0f} s")


def _signal_requeue_resume(watch: RunWatch, cluster: SlurmCluster) -> None:
    run, ckpts = watch.run, watch.run / "checkpoints"

    def job_started() -> bool:
        log = watch.batch_log()
        if log is not None:
            watch.job = int(log.stem.split("-", 1)[1])
        elif watch.proc.poll() is not None:
            pytest.fail(f"moerl train ended ({watch.proc.returncode}) before the job ran\n"
                        f"{tail(watch.out)}")
        return watch.job is not None

    watch.until(job_started, 120, "batch log (job not started)", cluster)
    assert watch.job is not None
    job = watch.job
    # At least one RL step done, and none saved yet (checkpoints only at the end
    # or on a signal), so the checkpoint found below is the signal's.
    watch.until(lambda: bool(trained_steps(run)), 600, "RL step finished", cluster)
    assert not complete_checkpoints(ckpts), "a checkpoint before any signal was sent"
    cluster.run("scancel", "--batch", "--signal=USR1", str(job))

    watch.until(lambda: cluster.job_field(job, "Restarts") == "1", 300, "requeue", cluster)
    saved = read_latest(ckpts)
    complete = complete_checkpoints(ckpts)
    diag = watch.diagnostics(cluster)
    assert saved is not None and complete == [saved], f"{complete}, latest {saved}\n{diag}"
    step = step_of(saved)
    assert step is not None and 1 <= step <= RESUME_STEPS, diag
    assert trained_steps(run) == list(range(step)), diag  # the step in progress finished
    state = json.loads((saved / "state.json").read_text())
    assert state["extra"]["rl"]["next_step"] == step, diag
    trainer = watch.trainer_log()
    assert trainer is not None, diag
    text = trainer.read_text(errors="replace")
    assert "stopping after this step: SIGUSR1" in text, diag
    batch = watch.batch_log()
    assert batch is not None, diag
    text = batch.read_text(errors="replace")
    assert "moerl: USR1 (time limit near)" in text, diag
    assert f"moerl: requeueing job {job}" in text, diag
    assert cluster.job_field(job, "JobState") not in {"COMPLETED", "FAILED", "CANCELLED"}, diag
    assert step < RESUME_STEPS, f"the signal came after the last step; nothing to resume\n{diag}"

    # The second attempt starts after SLURM's requeue delay (the credential lifetime:
    # 20 s in the test cluster's AuthInfo). It is not cut short: a launch before the
    # first attempt's credential expires is refused ("Job credential revoked").
    finished = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
    watch.until(lambda: cluster.job_field(job, "JobState") in finished, 600, "job end", cluster)
    diag = watch.diagnostics(cluster)
    assert cluster.job_field(job, "JobState") == "COMPLETED", diag
    assert cluster.job_field(job, "Restarts") == "1", diag
    try:
        code = watch.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"moerl train still waiting after the job completed\n{diag}")
    assert code == 0, diag

    # --open-mode=append: both attempts in one log; torchrun reports the rank's 85 as 1
    codes = re.findall(r"moerl: trainer exit code (\d+)", batch.read_text(errors="replace"))
    assert len(codes) == 2 and codes[0] in {str(REQUEUE_EXIT_CODE), "1"}, f"{codes}\n{diag}"
    assert codes[1] == "0", f"{codes}\n{diag}"
    ports = re.findall(r"moerl: trainer master \S+ \(\S+:(\d+)\)", batch.read_text())
    assert len(ports) == 2 and int(ports[1]) == int(ports[0]) + 1, ports  # one per attempt
    text = trainer.read_text(errors="replace")
    assert f"resumed from {saved} at step {step}" in text, diag
    assert text.count("SFT: loss") == 1, diag  # the checkpoint holds the policy after SFT
    # Each step logged once, in order: the resumed attempt went on from the saved step.
    assert trained_steps(run) == list(range(RESUME_STEPS)), diag
    assert read_latest(ckpts) == ckpts / step_name(RESUME_STEPS), diag
