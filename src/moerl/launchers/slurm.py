"""A RunPlan as one heterogeneous SLURM job.

Het group 0 is the trainer, then rollout, then reward (whichever the plan has).
Each stage is one `srun --het-group=N --overlap` job step: servers in the
background, each replica announcing itself in the rendezvous directory; the batch
shell waits for those announcements, then runs the trainer (torchrun per node, the
first node of group 0 as master) and watches both. On exit, error or cancel the
EXIT trap stops every step.

Pre-time-limit checkpointing: `--signal=B:USR1@<s>` sends USR1 to the batch shell
only; its trap forwards it to the trainer step, whose ranks checkpoint and exit
with REQUEUE_EXIT_CODE; the shell then runs `scontrol requeue`. A signal sent to a
step reaches its tasks (here torchrun) and, with proctrack/cgroup, every process of
the step: torchrun is told to forward USR1 (--signals-to-handle) and to give the
ranks until the time limit to finish their checkpoint before it kills them, and the
ranks start their helper processes with the stop signals ignored (`moerl.signals`).
Memory is asked for with --mem-per-cpu only: mixing it with --mem across
components makes srun fail.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from moerl.config import ClusterConfig
from moerl.launchers.slurm_shell import FINISH, FUNCTIONS, PREAMBLE
from moerl.launchers.stage_render import (
    Replica,
    fixed_port,
    placement_env,
    readiness,
    shell_words,
    torchrun_argv,
    under_torchrun,
)
from moerl.launchers.stages import RunPlan, StageSpec
from moerl.rendezvous import ENV_HOST, ENV_RENDEZVOUS, REQUEUE_EXIT_CODE

_GROUP_ORDER = ("trainer", "rollout", "reward", "environment")
_TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# A server announces the host the cluster names (cluster.advertise_host), else its node's.
_SERVER_HOST = '"${MOERL_ADVERTISE_HOST:-$(hostname)}"'


class SlurmError(RuntimeError):
    """sbatch refused a script or failed; the message is sbatch's own."""


@dataclass(frozen=True)
class SlurmConfig:
    """What the batch script is rendered with: the `cluster` group as the run read it,
    and what the rest of the run decides (`cluster.slurm_config` resolves these)."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    job_name: str = "moerl"
    """cluster.job_name, or the run directory's name."""
    torchrun: tuple[str, ...] = ("torchrun",)
    """cluster.torchrun, or `<launcher.python> -m torch.distributed.run`."""
    startup_timeout: int = 1800
    """launcher.startup_timeout_s: how long the batch shell waits for the servers."""

    def __post_init__(self) -> None:
        if self.startup_timeout < 1:
            raise ValueError("startup_timeout: must be >= 1")


@dataclass(frozen=True)
class Submission:
    job_id: int
    exit_code: int | None
    """the job's exit code when submitted with wait=True."""


def _het_groups(plan: RunPlan) -> list[StageSpec]:
    return sorted(plan.stages, key=lambda s: _GROUP_ORDER.index(s.name))


def _resources(stage: StageSpec) -> list[str]:
    """Options a component asks for and its step repeats (srun does not inherit them)."""
    per_node = stage.name == "trainer" or stage.server_torchrun
    tasks = "--ntasks-per-node=1" if per_node else f"--ntasks={stage.replicas}"
    gpus = [f"--gpus-per-node={stage.gpus_per_node}"] if stage.gpus_per_node else []
    # one task per node where torchrun starts the ranks (the trainer, servers across ranks)
    return [f"--nodes={stage.nodes}", tasks, f"--cpus-per-task={stage.cpus}", *gpus]


def _component(stage: StageSpec, cfg: SlurmConfig) -> list[str]:
    partition, mem_per_cpu = cfg.cluster.partition(stage.name), cfg.cluster.mem_per_cpu
    part = [f"--partition={partition}"] if partition else []
    mem = [f"--mem-per-cpu={mem_per_cpu}"] if mem_per_cpu else []
    return [*part, *_resources(stage), *mem]


def _header(plan: RunPlan, cfg: SlurmConfig) -> list[str]:
    cluster = cfg.cluster
    job = [f"--job-name={cfg.job_name}", f"--time={cluster.time}"]
    if cluster.account:
        job.append(f"--account={cluster.account}")
    # Append: a requeued run keeps the earlier attempt's output above its own.
    job += [f"--output={plan.log_dir}/slurm-%j.out", "--open-mode=append"]
    if cluster.requeue:
        job.append("--requeue")
    if cluster.signal_seconds:
        job.append(f"--signal=B:USR1@{cluster.signal_seconds}")
    lines: list[str] = []
    for i, stage in enumerate(_het_groups(plan)):
        if i:
            lines.append("#SBATCH hetjob")
        lines.append(f"# het group {i}: {stage.name}")
        lines += [f"#SBATCH {opt}" for opt in (job if i == 0 else []) + _component(stage, cfg)]
    return lines


def _exports(env: Mapping[str, str], *apart: str) -> str:
    """`export` of shell-ready values (expressions left unquoted); the `apart` variables
    on an export of their own after the rest."""
    first = [f"{k}={v}" for k, v in env.items() if k not in apart]
    rest = [f"{k}={env[k]}" for k in apart]
    return "".join(f"export {' '.join(words)}; " for words in (first, rest) if words)


def _stage_env(stage: StageSpec) -> str:
    return "".join(f"export {k}={shlex.quote(v)}; " for k, v in stage.env.items())


def _placement(stage: StageSpec, host: str, index: str) -> str:
    """The step's exports of one replica's placement (`stage_render.placement_env`),
    then the stage's env; the rendezvous directory is the batch shell's."""
    replica = Replica(host, fixed_port(stage, index), index)
    apart = (ENV_HOST,) if stage.is_server else ()
    return _exports(placement_env(stage, replica), *apart) + _stage_env(stage)


def _srun(stage: StageSpec, group: int | None, cfg: SlurmConfig) -> str:
    opts = [] if group is None else [f"--het-group={group}"]
    opts += ["--overlap", *_resources(stage), "--kill-on-bad-exit=1"]
    opts.append(f'--output="$LOG_DIR/{stage.name}-%j-%t.log"')
    command = " ".join(shlex.quote(a) for a in step_command(stage, cfg))
    return f"srun {' '.join(opts)} \\\n    {command} &"


def step_command(stage: StageSpec, cfg: SlurmConfig) -> list[str]:
    """argv of the job step that runs `stage` (what its srun line starts)."""
    if stage.name == "trainer":
        inner = _trainer_inner(stage, cfg)
    elif stage.server_torchrun:
        inner = _ranked_server_inner(stage, cfg)
    else:
        inner = _server_inner(stage)
    return ["bash", "-c", inner]


def _server_inner(stage: StageSpec) -> str:
    # Ports count over all replicas, not per node: fake nodes on one host (and
    # several replicas on one node) must not collide.
    return (_placement(stage, _SERVER_HOST, "$SLURM_PROCID")
            + 'trap "" USR1; exec ' + shell_words(stage))


def _ranked_server_inner(stage: StageSpec, cfg: SlurmConfig) -> str:
    """One task per node: replica SLURM_NODEID / span, its node rank the remainder; the
    replica's first node is its torchrun master (its rank 0 serves and announces)."""
    span = stage.span
    launcher = [shlex.quote(a) for a in cfg.torchrun]
    # Each attempt of a requeued job on ports of its own, as the trainer's master port.
    master_port = (f"$(({cfg.cluster.rollout_master_port} + REPLICA + {stage.replicas} * "
                   "${SLURM_RESTART_COUNT:-0}))")
    torchrun = torchrun_argv(stage, launcher, node_rank=f"$((SLURM_NODEID % {span}))",
                             master=('"${MOERL_ADVERTISE_HOST:-$SERVER_MASTER}"', master_port))
    return (
        f"REPLICA=$((SLURM_NODEID / {span})); "
        f'SERVER_MASTER=$(scontrol show hostnames "$SLURM_STEP_NODELIST" '
        f'| sed -n "$((REPLICA * {span} + 1))p"); '
        + _placement(stage, _SERVER_HOST, "$REPLICA")
        + f'trap "" USR1; exec {" ".join(torchrun)} {shell_words(stage)}'
    )


def _server_step(stage: StageSpec, group: int | None, cfg: SlurmConfig) -> str:
    return _srun(stage, group, cfg) + f"\nmoerl_started {stage.name} $!"


def _trainer_inner(stage: StageSpec, cfg: SlurmConfig) -> str:
    command = shell_words(stage)
    if under_torchrun(stage):
        launcher = [shlex.quote(a) for a in cfg.torchrun]
        extra = [f"--signals-to-handle={_TORCHRUN_SIGNALS}",
                 f"--shutdown-timeout={max(cfg.cluster.signal_seconds, 30)}"]
        torchrun = torchrun_argv(stage, launcher, node_rank="$SLURM_NODEID",
                                 master=("$MASTER_ADDR", "$MASTER_PORT"), extra=extra)
        command = f"{' '.join(torchrun)} {command}"
    return _placement(stage, '"$(hostname)"', "$SLURM_NODEID") + f"exec {command}"


def master_port_export(port: int) -> str:
    """The batch shell's MASTER_PORT line. Each attempt of a requeued job gets its own
    port: the node may still hold the previous attempt's rendezvous port (a lingering
    process, a socket not yet freed), and torchrun would fail with EADDRINUSE."""
    return f"export MASTER_PORT=$(({port} + ${{SLURM_RESTART_COUNT:-0}}))"


def _trainer_step(stage: StageSpec, group: int | None, cfg: SlurmConfig) -> str:
    nodelist = "${SLURM_JOB_NODELIST_HET_GROUP_0:-$SLURM_JOB_NODELIST}"
    return "\n".join([
        f'MASTER_NODE=$(scontrol show hostnames "{nodelist}" | head -n 1)',
        'export MASTER_ADDR="${MOERL_MASTER_ADDR:-$MASTER_NODE}"',
        master_port_export(cfg.cluster.master_port),
        'echo "moerl: trainer master $MASTER_NODE ($MASTER_ADDR:$MASTER_PORT)" >&2',
        _srun(stage, group, cfg),
        "TRAINER_PID=$!",
    ])  # fmt: skip


def cluster_addresses(cluster: ClusterConfig) -> list[str]:
    """The batch shell's address exports, where the cluster sets them."""
    lines = []
    if cluster.advertise_host:
        lines.append(f"export MOERL_ADVERTISE_HOST={shlex.quote(cluster.advertise_host)}")
    if cluster.master_addr:
        lines.append(f"export MOERL_MASTER_ADDR={shlex.quote(cluster.master_addr)}")
    return lines


def render_sbatch(plan: RunPlan, cfg: SlurmConfig) -> str:
    """The sbatch script for `plan` (a heterogeneous job when it has servers)."""
    groups = _het_groups(plan)
    het = len(groups) > 1
    lines = ["#!/bin/bash", *_header(plan, cfg), "", PREAMBLE.strip(), "set -uo pipefail"]
    lines += [
        f"export {ENV_RENDEZVOUS}={shlex.quote(str(plan.rendezvous_dir))}/$SLURM_JOB_ID",
        f"LOG_DIR={shlex.quote(str(plan.log_dir))}",
        f"GRACE={cfg.cluster.grace_s} STARTUP_TIMEOUT={cfg.startup_timeout}",
        f"REQUEUE={int(cfg.cluster.requeue)} REQUEUE_EXIT_CODE={REQUEUE_EXIT_CODE}",
        *cluster_addresses(cfg.cluster), FUNCTIONS.strip(), "",
        # A requeued attempt must not find the previous attempt's (dead) servers.
        'rm -rf "$MOERL_RENDEZVOUS_DIR"; mkdir -p "$MOERL_RENDEZVOUS_DIR" "$LOG_DIR"',
        *cfg.cluster.setup,
    ]
    for stage in plan.servers:
        lines += ["", _server_step(stage, groups.index(stage) if het else None, cfg)]
    for ready in map(readiness, plan.servers):
        lines.append(f"moerl_wait_announced {ready.stage} {ready.replicas} || exit 1")
    lines += ["", _trainer_step(plan.trainer, 0 if het else None, cfg), FINISH.strip(), ""]
    return "\n".join(lines)


def _sbatch(
    args: Sequence[str], script: str, env: Mapping[str, str] | None, sbatch: str
) -> subprocess.CompletedProcess[str]:
    # The script goes in on stdin: nothing to clean up, and sbatch keeps a copy.
    return subprocess.run(
        [sbatch, *args], input=script, capture_output=True, text=True, env=env, check=False
    )


def submit(
    script: str,
    wait: bool = False,
    *,
    env: Mapping[str, str] | None = None,
    sbatch: str = "sbatch",
    on_submit: Callable[[int], None] | None = None,
) -> Submission:
    """Submit `script`; with `wait`, block until the job ends and return its exit code.

    `on_submit` gets the job id as soon as sbatch prints it, before the wait.
    """
    args = [sbatch, "--parsable", *(["--wait"] if wait else [])]
    proc = subprocess.Popen(
        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    # The script goes in on stdin: nothing to clean up, and sbatch keeps a copy.
    proc.stdin.write(script)
    proc.stdin.close()
    first = proc.stdout.readline()
    match = re.match(r"^(\d+)", first.strip())
    if match is not None and on_submit is not None:
        on_submit(int(match.group(1)))
    try:
        # sbatch writes a line or two to stderr, far below a pipe's buffer, so
        # reading stdout to the end first cannot block it.
        rest = proc.stdout.read()
        err = proc.stderr.read() if proc.stderr else ""
        proc.wait()
    except BaseException:
        proc.kill()  # sbatch only waits; the job itself is the caller's to cancel
        proc.wait()
        raise
    if match is None:
        message = (err or first + rest).strip()
        raise SlurmError(f"sbatch failed (exit code {proc.returncode}): {message}")
    return Submission(int(match.group(1)), proc.returncode if wait else None)


def launch(
    plan: RunPlan, cfg: SlurmConfig, wait: bool = False,
    on_submit: Callable[[int], None] | None = None,
) -> Submission:
    """Render and submit `plan`; sbatch does not create the --output directory."""
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    return submit(render_sbatch(plan, cfg), wait, on_submit=on_submit)


def test_only(script: str, *, env: Mapping[str, str] | None = None, sbatch: str = "sbatch") -> str:
    """Check `script` against the cluster without running it; sbatch's verdict.

    Raises SlurmError carrying sbatch's message when the job could never run.
    """
    done = _sbatch(["--test-only"], script, env, sbatch)
    message = done.stderr.strip() or done.stdout.strip()
    if done.returncode != 0:
        raise SlurmError(message or f"sbatch --test-only failed ({done.returncode})")
    return message
