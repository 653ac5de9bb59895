"""The rendered sbatch scripts, run on the local SLURM cluster (conftest.py).

Stand-ins replace the real servers and trainer: a stdlib HTTP server with /health
that announces itself, and small trainer programs; the launcher around them (het
job, srun steps, rendezvous, torchrun, signals, requeue) is the real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from moerl.config import ClusterConfig, load_run_config
from moerl.launchers import slurm
from moerl.launchers.plan import build_run_plan
from moerl.launchers.slurm_run import slurm_job
from moerl.launchers.stages import RunPlan, StageSpec
from moerl.ports import free_port

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "slurm" / "tiny_demo.sbatch"
PY = sys.executable

SERVER = """
import http.server, json, os, sys
from moerl.rendezvous import announce_from_env

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"index": os.environ["MOERL_STAGE_INDEX"]}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
announce_from_env(os.environ["MOERL_HOST"], server.server_port)  # listening = healthy
server.serve_forever()
"""

CLIENT = """
import json, os, sys, httpx
from moerl.rendezvous import discover
found = discover(os.environ["MOERL_RENDEZVOUS_DIR"], "reward", 2, timeout=30)
codes = [httpx.get(f"http://{e}/health", trust_env=False).status_code for e in found]
keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES")
with open(sys.argv[1], "w") as f:
    json.dump({"endpoints": found, "codes": codes, **{k: os.environ.get(k) for k in keys}}, f)
sys.exit(0 if codes == [200, 200] else 3)
"""

CHECKPOINTER = """
import os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
attempt = os.environ.get("SLURM_RESTART_COUNT", "0")

def checkpoint_and_requeue(signum, frame):
    (out / f"checkpoint.{attempt}").write_text("saved")
    if sys.argv[2] == "marker":
        from moerl.rendezvous import request_requeue
        sys.exit(request_requeue())
    sys.exit(85)

signal.signal(signal.SIGUSR1, checkpoint_and_requeue)
(out / f"ready.{attempt}").write_text("")
while True:
    time.sleep(0.05)
"""


def _script(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _cfg() -> slurm.SlurmConfig:
    cluster = ClusterConfig(
        trainer_partition="gpu", reward_partition="cpu", time="00:05:00", mem_per_cpu="200M",
        signal_seconds=60, master_addr="127.0.0.1", advertise_host="127.0.0.1", grace_s=3,
    )  # fmt: skip
    return slurm.SlurmConfig(cluster, torchrun=(PY, "-m", "torch.distributed.run"),
                             startup_timeout=60)


def _plan(tmp: Path, trainer: StageSpec, reward: StageSpec | None) -> RunPlan:
    stages = (trainer,) if reward is None else (trainer, reward)
    return RunPlan(stages, rendezvous_dir=tmp / "rdv", log_dir=tmp / "logs")


def _until(cond: Callable[[], bool], timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            text = log.read_text(errors="replace") if log.exists() else "<no log>"
            pytest.fail(f"{what} within {timeout} s; {log}:\n{text[-4000:]}")
        time.sleep(0.1)


def test_het_job_server_and_client(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    result = tmp_path / "client.json"
    reward = StageSpec(
        "reward", (PY, _script(tmp_path / "server.py", SERVER), "{port}"),
        replicas=2, cpus=1, port_base=free_port(),
    )  # fmt: skip
    trainer = StageSpec(
        "trainer", (PY, _script(tmp_path / "client.py", CLIENT), str(result)), gpus_per_node=2
    )
    plan = _plan(tmp_path, trainer, reward)
    done = slurm.launch(plan, _cfg(), wait=True)
    log = (plan.log_dir / f"slurm-{done.job_id}.out").read_text()
    assert done.exit_code == 0, log
    got = json.loads(result.read_text())
    assert got["codes"] == [200, 200]
    assert got["endpoints"] == [
        f"127.0.0.1:{reward.port_base}",
        f"127.0.0.1:{reward.port_base + 1}",
    ]
    # torchrun ran the rank; the master is the first node of the trainer's group
    assert (got["RANK"], got["WORLD_SIZE"], got["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    # het group 0 (the trainer) is listed first; its first node is the master
    trainer_node = slurm_cluster.job_fields(done.job_id, "NodeList")[0]  # one node
    assert f"trainer master {trainer_node} (127.0.0.1:" in log, (trainer_node, log)
    assert got["CUDA_VISIBLE_DEVICES"] == "0,1"
    # every step is gone once the job has ended
    assert slurm_cluster.job_field(done.job_id, "JobState") == "COMPLETED"


def test_exit_code_comes_back(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    trainer = StageSpec("trainer", ("sh", "-c", "exit 7"), torchrun=False)
    done = slurm.launch(_plan(tmp_path, trainer, None), _cfg(), wait=True)
    assert done.exit_code == 7


@pytest.mark.parametrize("to", ["batch", "steps"])
def test_usr1_checkpoints_and_requeues(
    slurm_cluster: SlurmCluster, tmp_path: Path, to: str
) -> None:
    """batch: what `--signal=B:USR1@T` does before the time limit (without waiting
    for it); steps: a plain `scancel --signal=USR1 JOB`, the batch shell unaware."""
    reward = StageSpec(
        "reward", (PY, _script(tmp_path / "server.py", SERVER), "{port}"), port_base=free_port()
    )
    argv = (PY, _script(tmp_path / "ckpt.py", CHECKPOINTER), str(tmp_path))
    trainer = StageSpec("trainer", (*argv, "marker" if to == "steps" else "exit"))
    plan = _plan(tmp_path, trainer, reward)
    job = slurm.launch(plan, _cfg()).job_id
    log = plan.log_dir / f"slurm-{job}.out"
    try:
        _until((tmp_path / "ready.0").exists, 30, "trainer running", log)
        batch = ["--batch"] if to == "batch" else []
        slurm_cluster.run("scancel", *batch, "--signal=USR1", str(job))
        _until((tmp_path / "checkpoint.0").exists, 20, "checkpoint written", log)
        _until(lambda: slurm_cluster.job_field(job, "Restarts") == "1", 20, "requeued", log)
        assert slurm_cluster.job_field(job, "JobState") not in {"COMPLETED", "FAILED"}
        text = log.read_text()
        assert "moerl: requeueing job" in text and "trainer exit code" in text
    finally:
        slurm_cluster.run("scancel", str(job), check=False)


def _big_plan(tmp: Path, trainer_nodes: int = 64, gpus: int = 8) -> RunPlan:
    stages = (
        StageSpec("trainer", ("python", "-m", "moerl.train"), nodes=trainer_nodes,
                  gpus_per_node=gpus, cpus=96, ranks_per_node=gpus),
        StageSpec("rollout", ("moerl", "serve", "rollout", "--port", "{port}"), replicas=16,
                  nodes=16, gpus_per_node=8, cpus=96),
        StageSpec("reward", ("moerl", "serve", "reward", "--port", "{port}"), replicas=8,
                  nodes=4, cpus=32),
    )  # fmt: skip
    return RunPlan(stages, rendezvous_dir=tmp / "rdv", log_dir=tmp / "logs")


def test_test_only_large_cluster(slurm_cloud: dict[str, str], tmp_path: Path) -> None:
    cfg = slurm.SlurmConfig(ClusterConfig(
        trainer_partition="h100", rollout_partition="h100", reward_partition="cpu",
        mem_per_cpu="8G"))
    verdict = slurm.test_only(slurm.render_sbatch(_big_plan(tmp_path), cfg), env=slurm_cloud)
    assert "to start at" in verdict and "gpu[001-" in verdict, verdict
    with pytest.raises(slurm.SlurmError, match="Node count specification invalid"):
        slurm.test_only(slurm.render_sbatch(_big_plan(tmp_path, 300), cfg), env=slurm_cloud)
    with pytest.raises(slurm.SlurmError, match="configuration is not available"):
        slurm.test_only(slurm.render_sbatch(_big_plan(tmp_path, 8, 9), cfg), env=slurm_cloud)


# The shipped demo on a cluster, with the checkout at SHARED on every node's filesystem.
SHARED = Path("/shared/moerl")
DEMO_OVERRIDES = ["+experiment=demo", "launcher=slurm", "cluster=h100",
                  f"launcher.python={SHARED}/.venv/bin/python"]


def tiny_demo_sbatch() -> str:
    """What `moerl train <DEMO_OVERRIDES> --dry-run` prints from a checkout at SHARED."""
    cfg = load_run_config(DEMO_OVERRIDES)
    root = SHARED / "runs" / "demo"
    plan = build_run_plan(root, DEMO_OVERRIDES, cfg.launcher, cfg.rollout, cfg.rewards,
                          root / "arch.json", config_dir=SHARED / "configs")
    return slurm.render_sbatch(*slurm_job(plan, cfg, root.name))


def test_example_in_sync() -> None:
    """slurm/tiny_demo.sbatch is this render; MOERL_UPDATE_EXAMPLES=1 rewrites it."""
    text = tiny_demo_sbatch()
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    if os.environ.get("MOERL_UPDATE_EXAMPLES") == "1":
        EXAMPLE.parent.mkdir(exist_ok=True)
        EXAMPLE.write_text(text)
    assert EXAMPLE.read_text() == text, "run with MOERL_UPDATE_EXAMPLES=1 to refresh"
