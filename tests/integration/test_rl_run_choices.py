"""Choices a user makes, acting in one real run through the local stages (one run for
all, to keep the suite short):

- `rollout.pipeline_parallel=2`: the rollout server runs as torchrun on two ranks, one
  pipeline stage each; `rl.weight_sync=memory` streams every version after the first
  to both ranks, and the trainer's logprobs of the sampled tokens match the server's
  (each stage took the right slices of each version);
- `rl.advantage=reinforce_pp rl.kl_in_reward=0.5`: per-token REINFORCE++ advantages
  with the KL penalty in the reward, computed in the update from the reference's
  logprobs; zero while the policy is the reference, non-zero once it has moved.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

STEPS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    run = tmp_path_factory.mktemp("choices") / "run"
    argv = [sys.executable, "-m", "moerl.launchers.cli", "train", "+experiment=demo", "sft.steps=0",
            f"run_dir={run}", "checkpoint.dir=null", "logger.wandb_mode=disabled",
            f"rl.steps={STEPS}", "rl.prompts_per_step=2", "rl.group_size=4",
            "rl.max_generation_rounds=1", "rl.dynamic_sampling=false", "rl.eval_interval=0",
            "data.eval_size=2", "rl.sampling.max_tokens=8", "rollout.pipeline_parallel=2",
            "rollout.backend=static", "rl.weight_sync=memory", "rl.advantage=reinforce_pp",
            "rl.kl_in_reward=0.5"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    return run, steps


def test_a_pp2_server_takes_streamed_versions(run: tuple[Path, list[dict[str, Any]]]) -> None:
    path, steps = run
    assert "2 rank(s): tp 1, ep 1, pp 2" in (path / "logs" / "rollout.0.log").read_text()
    # the first version (the start) went by disk, each step's push in memory
    assert [r["weights/streamed"] for r in steps] == [float(s + 1) for s in range(STEPS)]
    for r in steps:
        assert r["train/tokens"] > 0
        assert r["train/logprob_gap/max_abs"] < 1e-3, r  # the server computed as we do


def test_reinforce_pp_with_kl_in_the_reward(run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, steps = run
    penalties = [r["train/kl_in_reward"] for r in steps]
    assert penalties[0] == pytest.approx(0.0, abs=1e-4)  # the policy is the reference
    assert any(abs(p) > 1e-6 for p in penalties[1:]), penalties
    for r in steps:
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0, r
