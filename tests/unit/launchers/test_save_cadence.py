"""The SIGUSR1 lead must cover a step plus a save, and a save cadence longer than a
save: checked on the Kimi-K2 recipe's own run, whose one save is 13.35 TB (267 s at
the h100 cluster's 50 GB/s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moerl.config import RunConfig
from moerl.launchers.cli import main
from moerl.launchers.recipes import compose_here, h100_site, load_recipe, trainer_overrides
from moerl.launchers.save_cadence import cadence_problems, planned_step_seconds, save_of

RECIPE = Path(__file__).resolve().parents[3] / "configs" / "experiment" / "kimi_k2_h100.yaml"


def _overrides(*extra: str) -> list[str]:
    return [*trainer_overrides(load_recipe(RECIPE), h100_site()), *extra]


def _kimi(tmp_path: Path, *extra: str) -> RunConfig:
    return compose_here(_overrides(f"run_dir={tmp_path}", *extra))


def test_the_recipe_covers_a_step_and_a_save(tmp_path: Path) -> None:
    cfg = _kimi(tmp_path)
    save = save_of(cfg)
    step = planned_step_seconds(cfg)
    assert save is not None and round(save.bytes / 1e12, 2) == 13.35
    assert round(save.seconds) == 267
    assert step is not None and 1 < step < 10  # the recipe's header: 2.14 s per step
    assert cfg.cluster.signal_seconds == 600 and cadence_problems(cfg, tmp_path / "m") == []


def test_a_short_lead_is_refused_naming_both_figures(tmp_path: Path) -> None:
    (problem,) = cadence_problems(_kimi(tmp_path, "cluster.signal_seconds=240"),
                                  tmp_path / "m")
    assert "cluster.signal_seconds=240" in problem
    assert "planner's estimate" in problem and "13.35 TB" in problem and "267 s" in problem
    assert "raise cluster.signal_seconds to at least 269" in problem


def test_a_requeued_job_is_held_to_its_measured_steps(tmp_path: Path) -> None:
    """The first attempt logged steps of up to 400 s: 600 s cannot hold one and a save."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "time/step": t}) + "\n"
                               for i, t in enumerate((350.0, 400.0, 380.0))))
    (problem,) = cadence_problems(_kimi(tmp_path), metrics)
    assert "one step (400 s, the longest step logged by an earlier attempt)" in problem
    assert "needs 667 s" in problem


def test_an_interval_shorter_than_a_save_is_refused(tmp_path: Path) -> None:
    (problem,) = cadence_problems(_kimi(tmp_path, "checkpoint.interval_minutes=3"),
                                  tmp_path / "m")
    assert "checkpoint.interval_minutes=3 is shorter than one save" in problem


def test_moerl_train_refuses_before_anything_starts(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [o for o in _overrides(f"run_dir={tmp_path / 'run'}", "cluster.signal_seconds=60")
                 if not o.startswith("init_weights=")]
    assert main(["train", *overrides, "--dry-run"]) == 2
    assert "configuration error: cluster.signal_seconds=60" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was written, nothing submitted
