"""Agent runs get environment servers as a stage of their own (locally and in the
SLURM script); prompt runs and `environments.servers=0` get none."""

from __future__ import annotations

from pathlib import Path

from moerl.agent.env_server import _parse
from moerl.config import load_run_config
from moerl.launchers.plan import build_run_plan
from moerl.launchers.slurm import SlurmConfig, render_sbatch
from moerl.launchers.stages import RunPlan


def _plan(tmp_path: Path, overrides: list[str]) -> RunPlan:
    cfg = load_run_config(overrides)
    environments = cfg.environments if cfg.rl.task_source == "agent" else None
    return build_run_plan(tmp_path, overrides, cfg.launcher, cfg.rollout, cfg.rewards,
                          tmp_path / "arch.json", environments=environments)


def test_agent_runs_start_environment_servers(tmp_path: Path) -> None:
    plan = _plan(tmp_path, ["rl.task_source=agent", "environments.servers=2",
                            "environments.max_sessions=8", "environments.idle_timeout_s=30"])
    (stage,) = [s for s in plan.stages if s.name == "environment"]
    assert stage.replicas == 2 and stage.is_server
    argv = stage.argv("127.0.0.1", 0, 0)
    assert argv[1:5] == ["-m", "moerl.launchers.cli", "serve", "env"]
    args = _parse(argv[5:])
    assert (args.max_sessions, args.idle_timeout) == (8, 30.0)
    assert [s.name for s in plan.servers] == ["reward", "environment", "rollout"]
    script = render_sbatch(plan, SlurmConfig())
    assert "# het group 3: environment" in script and "serve env" in script


def test_no_environment_stage_without_agent_episodes(tmp_path: Path) -> None:
    assert "environment" not in [s.name for s in _plan(tmp_path, []).stages]
    plan = _plan(tmp_path, ["rl.task_source=agent", "environments.servers=0"])
    assert "environment" not in [s.name for s in plan.stages]
