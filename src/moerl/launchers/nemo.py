"""A RunPlan as a nemo-run experiment: the job `slurm.render_sbatch` (or `local`) starts.

    moerl nemo +experiment=demo launcher=slurm cluster=h100   nemo-run's sbatch script
    moerl nemo +experiment=demo                               the local stage scripts

One `run.Script` and one executor per stage, as one task group: on SLURM they merge
into a heterogeneous `run.SlurmExecutor` (a resource group per stage), locally each
stage is a `run.LocalExecutor` process. `experiment` returns the `run.Experiment`
unlaunched (`with exp: exp.run()` submits).

On SLURM each stage's script is the `bash -c` body of its srun line in
`slurm.render_sbatch` (`slurm.step_command`); the trainer's is preceded by a wait
for the servers' announcements. Het groups, per-step srun options (nodes, tasks,
CPUs, GPUs, `--overlap`, logs), time, account, memory and the trainer's master
address are the same. What nemo-run cannot express, and what is done instead:

- per-group partitions and CPUs in the header: nemo-run writes one set of options
  for every group, so all groups get the trainer's partition and the largest
  `--cpus-per-task` (each step still asks srun for its own CPUs);
- GPUs: a group without GPUs gets `--gpus-per-node=0` when another group has some;
- group order: steps start in group order, a fixed sleep apart, with no wait between,
  so the servers come first and the trainer last (ours: group 0), and it waits itself;
- pre-time-limit stop: nemo-run's batch shell has no USR1 trap, so the signal goes to
  the steps (`--signal=USR1@s`, not `B:`): torchrun passes it on, servers ignore it;
- requeue: `sbatch --requeue`, and a requeue after any failed attempt up to `retries`
  times, not only on REQUEUE_EXIT_CODE; teardown and the watch for a dead step are
  nemo-run's own (the others killed a wait after the first step ends);
- the batch log goes where nemo-run reads it (its job directory, not `logs/`).
"""

from __future__ import annotations

import math
import shlex
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from moerl.launchers.slurm import (
    SlurmConfig,
    _resources,
    cluster_addresses,
    master_port_export,
    step_command,
)
from moerl.launchers.stage_render import (
    Replica,
    count_announced,
    fixed_port,
    local_command,
    placement_env,
    readiness,
    shared_env,
)
from moerl.launchers.stages import RunPlan, StageSpec
from moerl.rendezvous import ENV_RENDEZVOUS

# Servers first: the steps start in this order.
NEMO_ORDER = ("reward", "environment", "rollout", "trainer")


def import_nemo_run() -> ModuleType:
    """nemo_run, or an ImportError naming the extra that installs it."""
    try:
        import nemo_run
    except ImportError as err:
        extra = "install the `launch` extra: pip install 'moerl[launch]'"
        raise ImportError(f"nemo-run is not installed; {extra}") from err
    return nemo_run


def nemo_stages(plan: RunPlan) -> list[StageSpec]:
    """The plan's stages in nemo-run's task (and het group) order."""
    return sorted(plan.stages, key=lambda s: NEMO_ORDER.index(s.name))


def _wait_for_servers(plan: RunPlan, timeout: int) -> str:
    """Bash that returns once every server replica has announced itself."""
    lines = [f"deadline=$((SECONDS + {timeout}))"]
    for ready in map(readiness, plan.servers):
        stage_dir = f'"${ENV_RENDEZVOUS}/{ready.stage}"'
        count = f"$({count_announced(stage_dir)})"
        lines.append(f'until [ "{count}" -ge {ready.replicas} ]; do [ "$SECONDS" -lt '
                     f"\"$deadline\" ] || {{ echo 'moerl: {ready.stage} not announced after "
                     f"{timeout} s' >&2; exit 1; }}; sleep 1; done")
    return "\n".join(lines)


def slurm_scripts(plan: RunPlan, cfg: SlurmConfig) -> list[Any]:
    """One inline script per stage (nemo order): the body of its step in our sbatch."""
    run = import_nemo_run()
    scripts = []
    for stage in nemo_stages(plan):
        entrypoint, _, body = step_command(stage, cfg)
        if stage.name == "trainer" and plan.servers:
            body = _wait_for_servers(plan, cfg.startup_timeout) + "\n" + body
        scripts.append(run.Script(inline=body, entrypoint=entrypoint))
    return scripts


def _setup_lines(plan: RunPlan, cfg: SlurmConfig, trainer_group: int | None) -> str:
    """What our batch shell does before the steps: rendezvous dir, master address."""
    rdv, logs = shlex.quote(str(plan.rendezvous_dir)), shlex.quote(str(plan.log_dir))
    lines = [f"export {ENV_RENDEZVOUS}={rdv}/$SLURM_JOB_ID",
             f'rm -rf "${ENV_RENDEZVOUS}"; mkdir -p "${ENV_RENDEZVOUS}" {logs}']
    lines += [*cluster_addresses(cfg.cluster), *cfg.cluster.setup]
    nodelist = ("$SLURM_JOB_NODELIST" if trainer_group is None else
                f"${{SLURM_JOB_NODELIST_HET_GROUP_{trainer_group}:-$SLURM_JOB_NODELIST}}")
    lines += [f'MASTER_NODE=$(scontrol show hostnames "{nodelist}" | head -n 1)',
              'export MASTER_ADDR="${MOERL_MASTER_ADDR:-$MASTER_NODE}"',
              master_port_export(cfg.cluster.master_port)]
    return "\n".join(lines)


def slurm_executors(
    plan: RunPlan, cfg: SlurmConfig, *, job_dir: str | None = None, retries: int = 3,
    group_wait_s: int = 5,
) -> list[Any]:
    """One `run.SlurmExecutor` per stage (nemo order); nemo-run merges them into one job.

    `job_dir`: where nemo-run keeps its files on the cluster (default: `<run>/nemo`,
    on the shared filesystem); `retries`: requeues after a failed attempt.
    """
    run = import_nemo_run()
    stages = nemo_stages(plan)
    het = len(stages) > 1
    any_gpus = any(s.gpus_per_node for s in stages)
    cluster = cfg.cluster
    common: dict[str, Any] = dict(
        account=cluster.account,  # None: no --account line (nemo-run skips None options)
        partition=cluster.partition("trainer"), job_name_prefix=f"{cfg.job_name}-",
        time=cluster.time, mem_per_cpu=cluster.mem_per_cpu,
        cpus_per_task=max(s.cpus for s in stages),
        signal=f"USR1@{cluster.signal_seconds}" if cluster.signal_seconds else None,
        additional_parameters={"requeue": True} if cluster.requeue else {"no_requeue": True},
        retries=retries if cluster.requeue else 0,
        heterogeneous=het, wait_time_for_group_job=group_wait_s,
        setup_lines=_setup_lines(plan, cfg, stages.index(plan.trainer) if het else None),
        tunnel=run.LocalTunnel(job_dir=job_dir or str(plan.log_dir.parent / "nemo")),
        packager=run.Packager(),  # the checkout is on the shared filesystem already
    )
    return [
        run.SlurmExecutor(
            **common,
            nodes=s.nodes,
            # one torchrun per node (the trainer, servers across ranks); other
            # servers: --ntasks in srun_args
            ntasks_per_node=1 if s.name == "trainer" or s.server_torchrun
            else math.ceil(s.replicas / s.nodes),
            gpus_per_node=s.gpus_per_node if any_gpus else None,
            srun_args=["--overlap", *_resources(s), f"--output={plan.log_dir}/{s.name}-%j-%t.log"],
        )
        for s in stages
    ]


def slurm_executor(plan: RunPlan, cfg: SlurmConfig, **kwargs: Any) -> Any:
    """The merged heterogeneous executor (as nemo-run builds it from `slurm_executors`)."""
    run = import_nemo_run()
    executors = slurm_executors(plan, cfg, **kwargs)
    return run.SlurmExecutor.merge(executors, num_tasks=len(executors))


def local_scripts(
    plan: RunPlan, host: str = "127.0.0.1", startup_timeout: int = 300, run_id: str | None = None
) -> list[Any]:
    """One inline script per stage: every replica with the env `LocalLauncher` gives it.

    Servers listen on fixed ports (`stage_render.fixed_port`: `port_base`, else
    DEFAULT_PORTS, + replica); the rendezvous dir is a fresh `nemo-<run_id>` below the
    plan's (no stale servers). The script's env is what the replicas share, each
    replica's line exports its placement.
    """
    run = import_nemo_run()
    rendezvous = plan.rendezvous_dir / f"nemo-{run_id or time.strftime('%Y%m%d-%H%M%S')}"
    scripts = []
    for stage in nemo_stages(plan):
        waits = stage.name == "trainer" and bool(plan.servers)
        body = [_wait_for_servers(plan, startup_timeout)] if waits else []
        for index in range(stage.replicas):
            replica = Replica(host, fixed_port(stage, str(index)), str(index))
            placement = placement_env(stage, replica)
            exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in placement.items())
            command = shlex.join(local_command(stage, replica))
            body.append(f"(export {exports}; exec {command}) &")
        body.append("wait")
        env = shared_env(stage, str(rendezvous))
        scripts.append(run.Script(inline="\n".join(body), env=env))
    return scripts


def experiment(
    plan: RunPlan, slurm: SlurmConfig | None = None, *, title: str = "moerl",
    base_dir: str | None = None, **executor_kwargs: Any,
) -> Any:
    """The run as a `run.Experiment` (not launched): SLURM with `slurm`, else local."""
    run = import_nemo_run()
    if slurm is not None:
        scripts = slurm_scripts(plan, slurm)
        executors = slurm_executors(plan, slurm, **executor_kwargs)
    else:
        scripts = local_scripts(plan, **executor_kwargs)
        executors = [run.LocalExecutor() for _ in scripts]
    exp = run.Experiment(title, base_dir=base_dir, clean_mode=True, enable_goodbye_message=False)
    with exp:
        exp.add(scripts, executor=executors, name="moerl")
    return exp


def dryrun_text(exp: Any) -> str:
    """What nemo-run would submit: its sbatch script(s), or the local stage scripts."""
    exp.dryrun(log=False, delete_exp_dir=False)
    exp_dir = Path(exp._exp_dir)
    found = sorted(exp_dir.rglob("*_sbatch.sh")) + sorted(exp_dir.rglob("scripts/*.sh"))
    return "\n".join(f"# {p.relative_to(exp_dir)}\n{p.read_text()}" for p in found)


def nemo_main(overrides: list[str]) -> int:
    """`moerl nemo OVERRIDES`: print the dry run of the experiment for this config."""
    from moerl.config import config_dir, load_run_config
    from moerl.launchers.plan import build_run_plan
    from moerl.launchers.slurm_run import slurm_job

    try:
        import_nemo_run()
    except ImportError as err:
        print(f"moerl nemo: {err}", file=sys.stderr)
        return 1
    cfg = load_run_config(overrides)
    root = Path(cfg.run_dir).resolve()
    plan = build_run_plan(root, overrides, cfg.launcher, cfg.rollout, cfg.rewards,
                          root / "arch.json", config_dir=config_dir().resolve(),
                          precision=cfg.precision, tokenizer=cfg.tokenizer)
    with tempfile.TemporaryDirectory() as base:
        if cfg.launcher.kind == "slurm":
            plan, slurm_cfg = slurm_job(plan, cfg, root.name)
            exp = experiment(plan, slurm_cfg, title=root.name, base_dir=base)
        else:
            exp = experiment(plan, title=root.name, base_dir=base,
                             startup_timeout=int(cfg.launcher.startup_timeout_s))
        print(dryrun_text(exp))
    return 0
