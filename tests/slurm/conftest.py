"""A real SLURM cluster on this machine for the `slurm` tests.

One munged, one slurmctld and five `slurmd -N nX` fake nodes, all on 127.0.0.1,
everything (config, state, spool, logs, sockets) in a temporary directory; n1, n2
and n4 form partition `gpu` with four fake GPUs each (character devices, see
../../../shared/LOCAL_SLURM.md for why plain files do not work), n3 and n5 form
`cpu`: room for a trainer on two GPU nodes beside a rollout server on a third, and
for reward and environment servers on nodes of their own (the components of a
heterogeneous job do not share nodes).
`slurm_cloud` adds a controller without any slurmd whose CLOUD nodes stand for a
large H100 cluster, enough for `sbatch --test-only`.

Daemons run in the foreground as our own children, so teardown signals exactly
the pids we started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from moerl.ports import free_port

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
NODES = {"n1": 4, "n2": 4, "n3": 0, "n4": 4, "n5": 0}  # node -> fake GPUs
PARTITIONS = {"gpu": "n1,n2,n4", "cpu": "n3,n5"}


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    env: dict[str, str]
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, env=self.env, capture_output=True, text=True, check=check, timeout=60
        )

    def job_field(self, job_id: int, name: str) -> str:
        """The field of the job (of a het job: of its leader, shown first); "" if absent."""
        values = self.job_fields(job_id, name)
        return values[0] if values else ""

    def job_fields(self, job_id: int, name: str) -> list[str]:
        """The field of each component of a het job (one value for a plain job)."""
        out = self.run("scontrol", "show", "job", str(job_id), check=False).stdout
        return [word.split("=", 1)[1] for word in out.split() if word.startswith(f"{name}=")]


def _ensure_installed() -> None:
    if shutil.which("slurmctld") and shutil.which("sbatch") and shutil.which("munged"):
        return
    if os.geteuid() != 0:
        pytest.skip("SLURM is not installed and installing it needs root")
    apt = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=apt, capture_output=True)
    subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES],
        check=True, env=apt, capture_output=True,
    )  # fmt: skip


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )  # fmt: skip


def _stop(procs: list[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start_munge(root: Path) -> tuple[subprocess.Popen[bytes], Path]:
    mdir = root / "munge"
    mdir.mkdir(mode=0o755)
    mdir.chmod(0o755)  # munged refuses a socket dir others may write to
    key = mdir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = mdir / "munge.socket"
    proc = _start(
        ["munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
         f"--pid-file={mdir / 'munged.pid'}", f"--log-file={mdir / 'munged.log'}",
         f"--seed-file={mdir / 'munged.seed'}"],
        mdir / "munged.out", dict(os.environ),
    )  # fmt: skip
    _wait(lambda: sock.exists(), 10, "munged socket", mdir / "munged.log")
    return proc, sock


def _wait(ready: Callable[[], bool], timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else "<no log>"
            raise RuntimeError(f"{what} not ready after {timeout} s; {log}:\n{tail}")
        time.sleep(0.1)


def _proctrack() -> str:
    # proctrack/cgroup kills everything a step started, setsid'd children
    # included, and delivers step signals to every process of the step.
    probe = Path("/sys/fs/cgroup/freezer") / f"moerl-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
        return "proctrack/cgroup"
    except OSError:
        return "proctrack/linuxproc"


def _common_conf(root: Path, name: str, sock: Path, port: int) -> list[str]:
    return [
        f"ClusterName={name}", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={port}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        # A requeued job waits one credential lifetime before it may start again
        # (SLURM's default 120 s); 20 s keeps the requeue tests short.
        f"AuthInfo=socket={sock},cred_expire=20", f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n", f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid", f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory", "TaskPlugin=task/none",
        f"ProctrackType={_proctrack()}", "ReturnToService=1", "EnforcePartLimits=ALL",
        "SchedulerType=sched/backfill", "SchedulerParameters=bf_interval=1",
        "SlurmdParameters=config_overrides", "GresTypes=gpu", "MpiDefault=none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
        "DefMemPerCPU=500", "KillWait=3", "InactiveLimit=0",
    ]  # fmt: skip


def _fake_gpus(root: Path) -> Path:
    dev = root / "dev"
    dev.mkdir()
    for i in range(8):
        os.mknod(dev / f"nvidia{i}", 0o666 | 0o020000, os.makedev(1, 3))  # like /dev/null
    return dev


def _write_conf(root: Path, lines: list[str], gres: list[str]) -> Path:
    (root / "state").mkdir(parents=True, exist_ok=True)
    (root / "spool").mkdir(exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    (root / "gres.conf").write_text("\n".join(["AutoDetect=off", *gres]) + "\n")
    (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nConstrainDevices=no\n")
    return conf


def _client_env(conf: Path) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(conf)}


@pytest.fixture(scope="session")
def _munge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    _ensure_installed()
    proc, sock = _start_munge(tmp_path_factory.mktemp("munge"))
    yield sock
    _stop([proc])


@pytest.fixture(scope="session")
def slurm_cluster(_munge: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running three-node cluster; SLURM_CONF is exported while it lives."""
    root = tmp_path_factory.mktemp("slurm")
    dev = _fake_gpus(root)
    lines = _common_conf(root, "moerltest", _munge, free_port())
    gres = []
    for node, gpus in NODES.items():
        gres_opt = f" Gres=gpu:{gpus}" if gpus else ""
        lines.append(
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
            f"CPUs=16 RealMemory=64000{gres_opt} State=UNKNOWN"
        )
        if gpus:
            gres.append(f"NodeName={node} Name=gpu File={dev}/nvidia[0-{gpus - 1}]")
    lines += [
        f"PartitionName={name} Nodes={nodes} Default={'YES' if name == 'gpu' else 'NO'} "
        "MaxTime=INFINITE State=UP"
        for name, nodes in PARTITIONS.items()
    ]
    conf = _write_conf(root, lines, gres)
    env = _client_env(conf)
    cluster = SlurmCluster(root, conf, env)
    cluster.daemons.append(_start(["slurmctld", "-D", "-i"], root / "slurmctld.out", env))
    for node in NODES:
        cluster.daemons.append(_start(["slurmd", "-D", "-N", node], root / f"{node}.out", env))

    def all_idle() -> bool:
        for proc, name in zip(cluster.daemons, ["slurmctld", *NODES], strict=True):
            if proc.poll() is not None:  # fail now, with its log, not after the timeout
                log = root / (f"{name}.out" if name != "slurmctld" else "slurmctld.log")
                raise RuntimeError(f"{name} exited: {log.read_text(errors='replace')[-3000:]}")
        out = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
        return len(out) == len(NODES) and all(s == "idle" for s in out)

    mp = pytest.MonkeyPatch()
    try:
        _wait(all_idle, 30, "fake nodes", root / "slurmctld.log")
        mp.setenv("SLURM_CONF", str(conf))
        yield cluster
    finally:
        mp.undo()
        _shutdown(cluster)


def _shutdown(cluster: SlurmCluster) -> None:
    cluster.run("scancel", "--user=root", check=False)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and cluster.run("squeue", "-h", check=False).stdout.strip():
        time.sleep(0.2)
    cluster.run("scontrol", "shutdown", check=False)
    _stop(cluster.daemons)


@pytest.fixture(scope="session")
def slurm_cloud(_munge: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Client env (SLURM_CONF) for a controller-only stand-in of a 256 x 8 H100 cluster."""
    root = tmp_path_factory.mktemp("slurm-cloud")
    dev = _fake_gpus(root)
    lines = [
        *_common_conf(root, "moerlcloud", _munge, free_port()),
        "SuspendProgram=/bin/true", "ResumeProgram=/bin/true", "SuspendTime=600",
        "ResumeTimeout=600",
        "NodeName=gpu[001-256] CPUs=224 RealMemory=2000000 Gres=gpu:8 State=CLOUD",
        "NodeName=cpu[001-064] CPUs=192 RealMemory=750000 State=CLOUD",
        "PartitionName=h100 Nodes=gpu[001-256] Default=YES MaxTime=INFINITE State=UP",
        # configs/cluster/h100.yaml (and the rendered recipes) name the GPU partition gpu
        "PartitionName=gpu Nodes=gpu[001-256] MaxTime=INFINITE State=UP",
        "PartitionName=cpu Nodes=cpu[001-064] MaxTime=INFINITE State=UP",
    ]  # fmt: skip
    conf = _write_conf(root, lines, [f"NodeName=gpu[001-256] Name=gpu File={dev}/nvidia[0-7]"])
    env = _client_env(conf)
    ctld = _start(["slurmctld", "-D", "-i"], root / "slurmctld.out", env)

    def answers() -> bool:
        return subprocess.run(["scontrol", "ping"], env=env, capture_output=True).returncode == 0

    try:
        _wait(answers, 30, "cloud slurmctld", root / "slurmctld.log")
        yield env
    finally:
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True, check=False)
        _stop([ctld])
