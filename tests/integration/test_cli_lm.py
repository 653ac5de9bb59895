"""`moerl train-lm` end to end: a real training run of the tiny MoE from the CLI."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch


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


def _losses(proc: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    assert proc.returncode == 0, proc.stderr[-2000:]
    match = re.search(r"loss (\S+) -> (\S+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    return match.group(1), match.group(2)


def test_recompute_from_the_config_trains_the_same() -> None:
    """Recompute changes what is kept, not what is computed: the same losses."""
    plain = _losses(_moerl("train-lm", "train.steps=3"))
    assert _losses(_moerl("train-lm", "train.steps=3", "recompute=full")) == plain
    assert _losses(_moerl("train-lm", "train.steps=3", "recompute=selective",
                          "recompute.modules=[core_attn,mla_up_proj,moe]")) == plain


def test_fp8_on_a_machine_without_a_gpu_exits_2_naming_the_field() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks what a CPU-only machine refuses")
    proc = _moerl("train-lm", "precision=fp8")
    assert proc.returncode == 2
    assert "precision.transformer_impl=transformer_engine" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine refuses")
@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("precision.fp8=delayed", "precision.fp8=delayed"),
        ("precision.params_dtype=bf16", "precision.params_dtype=bf16"),
        ("precision.offload_optimizer=true", "precision.offload_optimizer"),
        ("recompute=selective", "recompute.modules"),
        ("recompute.modules=[attention]", "recompute.modules: unknown"),
    ],
)
def test_precision_this_machine_lacks_is_a_config_error_naming_the_field(
        override: str, field: str) -> None:
    """What the CLI above turns into exit code 2, for each field (in this process)."""
    from moerl.launchers.lm import load_lm_config
    from moerl.typed_config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(field)):
        load_lm_config([override])
