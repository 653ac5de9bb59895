"""A moerl rollout server across ranks in the run plan: torchrun on pp x lcm(tp, ep)
ranks of one node (whole nodes on a cluster when they do not fit one), the server's
own flags parsed by the server, and the settings it cannot serve refused at start-up
with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest

from moerl.config import load_run_config
from moerl.launchers.local import LocalLauncher
from moerl.launchers.plan import build_run_plan
from moerl.launchers.stages import RunPlan, StageSpec
from moerl.rollout.server import _parse


def _rollout_stage(tmp_path: Path, overrides: list[str]) -> StageSpec:
    cfg = load_run_config(overrides)
    plan = build_run_plan(tmp_path, overrides, cfg.launcher, cfg.rollout, cfg.rewards,
                          tmp_path / "arch.json", precision=cfg.precision)
    (rollout,) = [s for s in plan.stages if s.name == "rollout"]
    return rollout


def _rollout_argv(tmp_path: Path, overrides: list[str]) -> list[str]:
    return _rollout_stage(tmp_path, overrides).argv("127.0.0.1", 0, 0)


@pytest.mark.parametrize(("tp", "ep", "pp", "ranks"),
                         [(2, 1, 1, 2), (1, 4, 1, 4), (2, 2, 1, 2), (2, 4, 1, 4), (1, 1, 2, 2),
                          (2, 2, 2, 4)])
def test_server_runs_on_pp_times_lcm_of_tp_and_ep_ranks(tmp_path: Path, tp: int, ep: int,
                                                        pp: int, ranks: int) -> None:
    stage = _rollout_stage(tmp_path, [f"rollout.tensor_parallel={tp}",
                                      f"rollout.expert_parallel={ep}",
                                      f"rollout.pipeline_parallel={pp}"])
    assert (stage.ranks_per_node, stage.span, stage.server_torchrun) == (ranks, 1, True)
    plan = RunPlan((_trainer(), stage), tmp_path / "rdv", tmp_path / "logs")
    argv = LocalLauncher(plan).replica_command(stage, 0, 0)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert f"--nproc-per-node={ranks}" in argv and "--standalone" in argv
    server = argv[argv.index("--no-python") + 1:]
    assert server[1:5] == ["-m", "moerl.launchers.cli", "serve", "rollout"]
    args = _parse(server[5:])
    assert (args.tp, args.ep, args.pp, args.backend) == (tp, ep, pp, "auto")


def _trainer() -> StageSpec:
    return StageSpec(name="trainer", command=("true",))


def test_one_rank_server_has_no_torchrun(tmp_path: Path) -> None:
    stage = _rollout_stage(tmp_path, [])
    assert not stage.server_torchrun
    plan = RunPlan((_trainer(), stage), tmp_path / "rdv", tmp_path / "logs")
    argv = LocalLauncher(plan).replica_command(stage, 0, 0)
    assert "torch.distributed.run" not in argv
    args = _parse(argv[argv.index("rollout") + 1:])
    assert (args.tp, args.ep) == (1, 1)


def test_an_engine_larger_than_a_node_spans_whole_nodes(tmp_path: Path) -> None:
    stage = _rollout_stage(tmp_path, [
        "rollout.expert_parallel=32", "rollout.gpus_per_node=8", "rollout.servers=2",
        "rollout.nodes=8"])  # fmt: skip
    assert (stage.ranks_per_node, stage.span, stage.nodes, stage.replicas) == (8, 4, 8, 2)
    plan = RunPlan((_trainer(), stage), tmp_path / "rdv", tmp_path / "logs")
    with pytest.raises(ValueError, match="launcher=slurm"):
        LocalLauncher(plan).replica_command(stage, 0, 0)


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.tensor_parallel=2", "rollout.backend=dynamic"], r"rollout\.backend=continuous"),
    (["rollout.pipeline_parallel=2", "rollout.backend=continuous"], r"rollout\.backend=static"),
    (["rollout.expert_parallel=2", "rollout.speculative=mtp"], r"rollout\.speculative=none"),
    (["rollout.tensor_parallel=16", "rollout.gpus_per_node=8"], r"need rollout\.nodes=2"),
    (["rollout.tensor_parallel=12", "rollout.gpus_per_node=8"], r"multiple of 8"),
    (["rollout.tensor_parallel=0"], r"rollout\.tensor_parallel: must be >= 1"),
])  # fmt: skip
def test_what_a_server_across_ranks_cannot_serve_is_refused(
        tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _rollout_argv(tmp_path, overrides)
