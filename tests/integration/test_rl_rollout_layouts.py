"""A rollout server across ranks in a real run through the local stages: `moerl train`
with `rollout.pipeline_parallel=2` starts the server as torchrun on two ranks (one
stage each), and `rl.weight_sync=memory` streams every version after the first to
both ranks. The trainer's logprobs of the sampled tokens match the server's: each
stage took the right slices of each version."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 3


def test_a_pp2_server_takes_streamed_versions_in_a_run(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "moerl.launchers.cli", "train", "+experiment=demo", "sft.steps=0",
            f"run_dir={run}", "checkpoint.dir=null", "logger.wandb_mode=disabled",
            f"rl.steps={STEPS}", "rl.prompts_per_step=2", "rl.group_size=4",
            "rl.max_generation_rounds=1", "rl.dynamic_sampling=false", "rl.eval_interval=0",
            "data.eval_size=2", "rl.sampling.max_tokens=8", "rollout.pipeline_parallel=2",
            "rollout.backend=static", "rl.weight_sync=memory"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "2 rank(s): tp 1, ep 1, pp 2" in (run / "logs" / "rollout.0.log").read_text()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "weights/version" in r]
    # the first version (the start) went by disk, each step's push in memory
    assert [r["weights/streamed"] for r in steps] == [float(s + 1) for s in range(STEPS)]
    for r in steps:
        assert r["train/tokens"] > 0
        assert r["train/logprob_gap/max_abs"] < 1e-3, r  # the server computed as we do
