"""`moerl train`: start the run's stages; `moerl trainer`: the trainer stage itself.

`moerl train` checks the whole configuration at once (before anything starts),
writes it next to the run, and starts the reward servers, the rollout servers
and the trainer (torchrun) as local processes or as a SLURM heterogeneous job.
The trainer stage (`moerl trainer`, every rank) does the optional SFT warm-up,
publishes the weights the rollout servers start from, and runs `rl.loop.run_steps`.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from moerl.config import RunConfig, config_dir, load_run_config
from moerl.launchers.plan import RunLayout, build_run_plan
from moerl.launchers.save_cadence import check_save_cadence
from moerl.launchers.stages import RunPlan
from moerl.observability import METRICS_FILE
from moerl.rendezvous import REQUEUE_EXIT_CODE
from moerl.typed_config import to_dict


def _prepare_run_dir(cfg: RunConfig) -> tuple[Path, Path]:
    root = Path(cfg.run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    arch_file = root / "arch.json"
    arch_file.write_text(json.dumps(asdict(cfg.model)))
    return root, arch_file


def launch_run(overrides: list[str], dry_run: bool = False) -> int:
    """Launch the run described by `overrides` (locally or on SLURM)."""
    from moerl.launchers.lm import (
        check_layout_at_start,
        check_precision_at_start,
        check_tokenizer_at_start,
    )

    cfg = load_run_config(overrides)
    check_layout_at_start(cfg.model, cfg.parallel,
                          world=cfg.launcher.trainer_ranks * cfg.launcher.trainer_nodes)
    if cfg.launcher.kind == "local":  # the stages run on this machine: check it has what they ask
        check_precision_at_start(cfg.precision, cfg.recompute)
        check_tokenizer_at_start(cfg.tokenizer, cfg.model.vocab_size)
    check_save_cadence(cfg, Path(cfg.run_dir).resolve() / METRICS_FILE)
    root, arch_file = _prepare_run_dir(cfg)
    plan = build_run_plan(root, overrides, cfg.launcher, cfg.rollout, cfg.rewards, arch_file,
                          config_dir=config_dir().resolve(), precision=cfg.precision,
                          tokenizer=cfg.tokenizer,
                          environments=cfg.environments if cfg.runs_episodes else None)
    console = Console(stderr=True)
    if cfg.launcher.kind == "slurm":
        from moerl.launchers.slurm_run import run_on_slurm

        return run_on_slurm(plan, cfg, root.name, dry_run, console)
    if dry_run:  # what would start here, and nothing more
        _print_local_plan(plan, console)
        return 0
    from moerl.launchers.local import LocalLauncher, StageFailed

    launcher = LocalLauncher(plan, startup_timeout=cfg.launcher.startup_timeout_s, echo=True)
    try:
        code = launcher.run()
    except StageFailed as err:
        # markup off: the log tail may hold [brackets]; soft wrap: paths stay whole
        console.print(f"run failed: {err}", style="red", markup=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        return 130
    if code == REQUEUE_EXIT_CODE:
        console.print(f"the trainer checkpointed on a stop signal and exited {code} (requeue); "
                      "the same command continues the run", markup=False, soft_wrap=True)
        return code
    if code != 0:
        console.print(f"the trainer stage exited with {code}; logs in {plan.log_dir}",
                      style="red", markup=False)
    return code


def _print_local_plan(plan: RunPlan, console: Console) -> None:
    """Each stage's processes and command line, as the local launcher would start them."""
    for stage in (*plan.servers, plan.trainer):
        count = (f"torchrun x {stage.ranks_per_node}" if stage.name == "trainer"
                 else f"{stage.replicas} process(es)")
        console.print(f"{stage.name} ({count}): {shlex.join(stage.command)}",
                      markup=False, soft_wrap=True)
    console.print(f"rendezvous: {plan.rendezvous_dir}  logs: {plan.log_dir}",
                  markup=False, soft_wrap=True)


def run_trainer_stage(overrides: list[str]) -> int:
    """The trainer stage: every rank runs this under torchrun."""
    from moerl.launchers.lm import check_precision_at_start
    from moerl.launchers.trainer_stage import trainer_main

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_run_config(overrides, world_size=world)
    check_precision_at_start(cfg.precision, cfg.recompute)  # on the node that computes
    dirs = RunLayout(Path(cfg.run_dir).resolve())
    check_save_cadence(cfg, dirs.root / METRICS_FILE)  # a requeued job: its steps measured
    return trainer_main(cfg, dirs)


if __name__ == "__main__":
    sys.exit(launch_run(sys.argv[1:]))
