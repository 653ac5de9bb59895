"""`moerl train-lm` end to end: a real training run of the tiny MoE from the CLI."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def _moerl(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "moerl.launchers.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_train_lm_loss_falls() -> None:
    proc = _moerl("train-lm", "train.steps=25")
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", proc.stdout).groups())  # type: ignore[union-attr]
    assert last < first - 0.5


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("parallel.tp=3", "tp*pp*cp"),
        ("train.micro_batch=3", "train.global_batch"),
        ("optim.lr=fast", "optim.lr"),
        ("parallel.dp=2", "parallel.dp=1"),
    ],
)
def test_bad_config_fails_at_start_naming_the_field(override: str, field: str) -> None:
    proc = _moerl("train-lm", override)
    assert proc.returncode == 2
    assert field in proc.stderr
