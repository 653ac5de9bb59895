"""Metrics file, W&B offline run directory, timers and the plot."""

from __future__ import annotations

import time
from pathlib import Path

from moerl.observability import LoggerConfig, MetricsLogger, StepTimer, read_metrics


def test_metrics_jsonl_wandb_offline_and_plot(tmp_path: Path) -> None:
    logger = MetricsLogger(LoggerConfig(wandb_mode="offline"), tmp_path, {"lr": 1e-3})
    for step in range(3):
        logger.log(step, {"reward/mean": 0.1 * step, "loss": 1.0 - step})
    plot = logger.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["reward/mean"] == 0.2
    assert plot is not None and plot.stat().st_size > 1000
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline W&B run was written"


def test_plot_skipped_without_the_key(tmp_path: Path) -> None:
    logger = MetricsLogger(LoggerConfig(wandb_mode="disabled"), tmp_path, {})
    logger.log(0, {"loss": 1.0})
    assert logger.close() is None


def test_step_timer_accumulates_phases() -> None:
    timer = StepTimer()
    with timer.phase("rollout"):
        time.sleep(0.02)
    with timer.phase("rollout"):
        time.sleep(0.02)
    with timer.phase("train"):
        pass
    metrics = timer.as_metrics()
    assert metrics["time/rollout"] >= 0.04
    assert set(metrics) == {"time/rollout", "time/train"}  # the loop measures time/step
