"""The SIGUSR1 lead and the save cadence of a SLURM run, checked at start-up.

SLURM sends SIGUSR1 `cluster.signal_seconds` before the job's time limit; the trainer
finishes the step it is in, saves and exits for requeue. When the step and the save
do not fit in that lead, SLURM kills the job first and the requeued job resumes from
the checkpoint before (with no `checkpoint.interval_minutes`, from the start). So a
run is refused before it starts when

    cluster.signal_seconds < step + save

naming both figures:

    save  `planning.checkpoint_time`: the checkpoint's bytes at
          `cluster.checkpoint_write_gbps` (left out when that is unknown);
    step  the longest RL step an earlier attempt of this run logged (`time/step` in
          its metrics.jsonl: a requeued job knows), else the planner's estimate of the
          step's optimizer updates (`planning.cost`, `rl.updates_per_step` of them, on
          the trainer's GPUs), which leaves out generation: a lower bound, so what it
          refuses cannot fit.

A `checkpoint.interval_minutes` shorter than one save is refused too: each save
waits for the one before, so the saves would run back to back.
"""

from __future__ import annotations

from pathlib import Path

from moerl.config import RunConfig
from moerl.observability import read_metrics
from moerl.planning.checkpoint_time import SavePlan, save_plan
from moerl.planning.cost import ClusterSpec, step_time
from moerl.planning.memory import RunSettings
from moerl.planning.run_fields import settings_of_run
from moerl.typed_config import ConfigError


def planned_run(cfg: RunConfig) -> RunSettings | None:
    """The planner's view of the run's update (None: precision `auto`, unplannable)."""
    try:
        fields = settings_of_run(cfg.precision, cfg.recompute)
    except ValueError:
        return None
    rl = cfg.rl
    return RunSettings(
        seq_length=cfg.seq_length, micro_batch_size=max(rl.token_budget // cfg.seq_length, 1),
        global_batch_size=max(rl.prompts_per_step * rl.group_size // rl.updates_per_step, 1),
        precision=fields.precision, layer_spec=fields.layer_spec, recompute=fields.recompute,
        critic=rl.advantage == "gae")


def planned_step_seconds(cfg: RunConfig) -> float | None:
    """The planner's seconds for the step's updates on the trainer's GPUs (None:
    no GPUs, or a precision the planner cannot name)."""
    run = planned_run(cfg)
    launcher = cfg.launcher
    if run is None or launcher.gpus_per_node < 1:
        return None
    cluster = ClusterSpec(nodes=launcher.trainer_nodes, gpus_per_node=launcher.gpus_per_node)
    return step_time(cfg.model, cfg.parallel, run, cluster).total * cfg.rl.updates_per_step


def measured_step_seconds(metrics_file: Path | None) -> float | None:
    """The longest RL step an earlier attempt logged (None: none did)."""
    if metrics_file is None or not metrics_file.is_file():
        return None
    steps = [float(row["time/step"]) for row in read_metrics(metrics_file) if "time/step" in row]
    return max(steps, default=None)


def save_of(cfg: RunConfig) -> SavePlan | None:
    gbps = cfg.cluster.checkpoint_write_gbps
    run = planned_run(cfg) or RunSettings(precision="fp32")  # a run in fp32 on CPU
    return None if gbps is None else save_plan(cfg.model, run, gbps)


def cadence_problems(cfg: RunConfig, metrics_file: Path | None) -> list[str]:
    """What of the lead and the cadence cannot work (empty: nothing), each naming
    the figures and the fields. `metrics_file`: the run's, where an earlier attempt
    logged its steps (None: the planned step only)."""
    if not cfg.checkpoint.enabled:
        return []
    save, problems = save_of(cfg), []
    save_s = save.seconds if save is not None else 0.0
    minutes = cfg.checkpoint.interval_minutes
    if save is not None and 0 < minutes * 60 < save_s:
        problems.append(f"checkpoint.interval_minutes={minutes:g} is shorter than one save "
                        f"({save.describe()}); saves would run back to back")
    measured = measured_step_seconds(metrics_file)
    step_s = measured if measured is not None else planned_step_seconds(cfg)
    lead = cfg.cluster.signal_seconds
    if cfg.launcher.kind != "slurm" or lead == 0 or step_s is None:
        return problems
    if lead < step_s + save_s:
        how = ("the longest step logged by an earlier attempt" if measured is not None
               else "the planner's estimate of its updates, generation not counted")
        saving = (f" plus one save ({save.describe()})" if save is not None else "")
        problems.append(
            f"cluster.signal_seconds={lead}: SIGUSR1 comes {lead} s before the time limit, "
            f"but one step ({step_s:.0f} s, {how}){saving} needs {step_s + save_s:.0f} s; "
            f"raise cluster.signal_seconds to at least {step_s + save_s:.0f}, or the job "
            "is killed before its checkpoint is complete")
    return problems


def checkpoint_line(cfg: RunConfig) -> str:
    """One save and the SIGUSR1 lead against the planned step, for a report."""
    save, step = save_of(cfg), planned_step_seconds(cfg)
    if save is None:
        return "checkpoint: cluster.checkpoint_write_gbps unknown, no save time planned"
    lead = cfg.cluster.signal_seconds
    line = f"checkpoint: one save {save.describe()}"
    if cfg.checkpoint.interval_minutes:
        line += f", one every {cfg.checkpoint.interval_minutes:g} minutes"
    if lead and step is not None:
        line += (f"; SIGUSR1 {lead} s before the limit for a {step:.1f} s step (planned, "
                 f"updates only) and a save")
    return line


def check_save_cadence(cfg: RunConfig, metrics_file: Path) -> None:
    """Refuse a run whose SIGUSR1 lead or save cadence cannot work (ConfigError)."""
    if problems := cadence_problems(cfg, metrics_file):
        raise ConfigError("; ".join(problems))
