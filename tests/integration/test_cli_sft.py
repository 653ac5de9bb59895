"""`moerl sft` end to end: packed instruction data from JSONL, weights that start the
next run, resume, and errors at start-up that name the field."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moerl.data.code_tasks import make_tasks
from moerl.launchers.cli import main


def _moerl(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "moerl.launchers.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _losses(proc: subprocess.CompletedProcess[str]) -> tuple[float, float]:
    found = re.search(r"SFT: loss (\S+) -> (\S+)", proc.stdout)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    return float(found.group(1)), float(found.group(2))


@pytest.fixture(scope="module")
def instruction_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sft") / "train.jsonl"
    rows = [{"prompt": t.prompt, "response": t.reference} for t in make_tasks(64, seed=5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_packs_trains_resumes_and_starts_the_next_run(
    instruction_data: Path, tmp_path: Path
) -> None:
    common = ["sft.pack=true", "sft.seq_length=176", "sft.global_batch=4", "sft.micro_batch=2",
              "sft.lr=3e-3", "sft.warmup_steps=2", f"sft.data_path={instruction_data}"]
    first = _moerl("sft", *common, "sft.steps=12", f"out_dir={tmp_path / 'a'}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert re.search(r"64 examples packed into \d+ rows of 176", first.stdout)
    start, end = _losses(first)
    assert end < start - 2.0
    weights = tmp_path / "a" / "weights"
    assert (weights / "moerl_weights_complete").is_file()

    # The same command again: the checkpoint at step 12 is found, nothing is retrained.
    again = _moerl("sft", *common, "sft.steps=12", f"out_dir={tmp_path / 'a'}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "at step 12" in again.stderr
    assert "SFT: loss" not in again.stdout

    # A new run from those weights starts where the first one ended.
    follow = _moerl("sft", *common, "sft.steps=2", f"init_weights={weights}",
                    f"out_dir={tmp_path / 'b'}")
    assert follow.returncode == 0, follow.stderr[-3000:]
    assert _losses(follow)[0] < start - 2.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("init_weights=/nonexistent", "init_weights: /nonexistent is not a complete weights"),
        ("sft.data_path=/nonexistent.jsonl", "sft.data_path: /nonexistent.jsonl is not a file"),
        ("sft.micro_batch=3", "sft.global_batch"),
        ("sft.steps=0", "sft.steps"),
        ("sft.pakc=true", "pakc"),
    ],
)
def test_bad_sft_config_fails_at_start_naming_the_field(
    override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sft", override]) == 2  # before any process group or model exists
    assert message in capsys.readouterr().err


def test_rl_run_refuses_incomplete_init_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "w").mkdir()
    assert main(["train", f"init_weights={tmp_path / 'w'}", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "init_weights:" in err and "moerl sft" in err
    assert not (tmp_path / "run").exists()  # refused before the run dir is made
