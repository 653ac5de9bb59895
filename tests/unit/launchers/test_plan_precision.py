"""The run's precision reaches the rollout server's command line: the server parses
exactly the run config's fields (whichever the machine that runs it may refuse)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moerl.config import load_run_config
from moerl.launchers.plan import build_run_plan
from moerl.rollout.server import _parse, precision_of


@pytest.mark.parametrize("overrides", [
    [], ["precision=fp8"], ["precision=bf16", "precision.fp8=mxfp8"], ["precision=cpu"],
])  # fmt: skip
def test_rollout_server_gets_the_runs_precision(tmp_path: Path, overrides: list[str]) -> None:
    cfg = load_run_config(overrides)
    plan = build_run_plan(tmp_path, overrides, cfg.launcher, cfg.rollout, cfg.rewards,
                          tmp_path / "arch.json", precision=cfg.precision)
    (rollout,) = [s for s in plan.stages if s.name == "rollout"]
    argv = [a.format(host="127.0.0.1", port=0) for a in rollout.command]
    args = _parse(argv[argv.index("rollout") + 1:])
    assert precision_of(args) == cfg.precision


def test_fp8_primary_weights_reach_the_rollout_server(tmp_path: Path) -> None:
    """precision=fp8 serves one-byte weights too: without --fp8-param a Kimi-K2 rollout
    rank at TP1/EP32 would build 43.4B parameters in bf16 (80.9 GiB)."""
    cfg = load_run_config(["precision=fp8"])
    plan = build_run_plan(tmp_path, [], cfg.launcher, cfg.rollout, cfg.rewards,
                          tmp_path / "arch.json", precision=cfg.precision)
    (rollout,) = [s for s in plan.stages if s.name == "rollout"]
    argv = [a.format(host="127.0.0.1", port=0) for a in rollout.command]
    assert "--fp8-param" in argv
    assert precision_of(_parse(argv[argv.index("rollout") + 1:])).fp8_param


def test_precision_groups_compose_as_documented() -> None:
    fp8 = load_run_config(["precision=fp8"]).precision
    assert (fp8.transformer_impl, fp8.params_dtype, fp8.fp8, fp8.fp8_param) == (
        "transformer_engine", "bf16", "tensorwise", True)
    assert load_run_config([]).precision.transformer_impl == "auto"
    selective = load_run_config(["recompute=selective"]).recompute
    assert (selective.granularity, selective.modules) == (
        "selective", ["layernorm", "mla_up_proj", "moe_act"])
