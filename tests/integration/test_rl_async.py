"""`rl.mode=async` through the real stages (reward server with the sandbox, rollout
server, trainer as local processes): the next step's samples are generated while the
current one trains, so trained samples are one weight version old, never more. The
policy update runs with full activation recompute (`recompute=full`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 4


def test_async_run_trains_one_version_stale_samples(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "moerl.launchers.cli", "train", "+experiment=demo", "sft.steps=0",
            f"run_dir={run}", "checkpoint.dir=null", "logger.wandb_mode=disabled",
            f"rl.steps={STEPS}", "rl.prompts_per_step=2", "rl.group_size=4",
            "rl.max_generation_rounds=1", "rl.dynamic_sampling=false", "rl.mode=async",
            "rl.max_staleness=1", "rl.eval_interval=0", "data.eval_size=2",
            "rl.sampling.max_tokens=8",
            "recompute=full"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert not (run / "sft").exists()  # a fresh model: no SFT warm-up
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "weights/version" in r]
    assert [r["weights/version"] for r in steps] == [float(s + 1) for s in range(STEPS)]
    trained = [r["async/staleness_max_trained"] for r in steps]
    assert max(trained) == 1.0, trained  # the overlap happened: a batch of the old weights
    assert all(r["async/dropped_stale"] == 0 for r in steps)
    for r in steps:
        assert r["time/step"] > 0 and r["train/tokens"] > 0
