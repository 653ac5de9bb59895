"""The shipped quick recipe learns: `moerl train +experiment=quick` (SFT, then 8 GRPO
steps with real reward and rollout servers and the sandbox) raises the sampled
reward. (The held-out greedy pass rate is printed, not asserted: after this SFT the
greedy answer is mostly the demonstrations' majority already; RL makes the sampled
answers agree with it.)"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest


def test_quick_recipe_reward_rises(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "moerl.launchers.cli", "train", "+experiment=quick",
            f"run_dir={run}", "checkpoint.dir=null"]
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    evals = [r["eval/pass_rate"] for r in rows if "eval/pass_rate" in r]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    print(f"quick recipe in {time.monotonic() - start:.0f}s: sampled reward "
          f"{' '.join(f'{r:.3f}' for r in rewards)}; first 3 {first:.3f}, last 3 {last:.3f}; "
          f"held-out pass rate {evals[0]:.3f} -> {evals[-1]:.3f}")
    assert len(rewards) == 8 and len(evals) == 2
    assert all(r["reward/infra_errors"] == 0 for r in rows if "reward/infra_errors" in r)
    assert last > first + 0.1
