"""`moerl sft` with packed rows under context parallelism (two ranks, each holding
its two load-balanced chunks of every row, documents kept apart by the ring) gives
the single process's per-step losses."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from worker_launch import SRC, worker_command, worker_env

from moerl.data.code_tasks import make_tasks

CLI = SRC / "moerl" / "launchers" / "cli.py"


def _losses(ranks: int, args: list[str]) -> list[float]:
    proc = subprocess.run(worker_command(CLI, ranks, ["sft", *args]), env=worker_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [float(x) for x in re.findall(r"SFT step \d+/\d+  loss (\S+)", proc.stdout)]


def test_packed_sft_under_cp2_matches_one_process(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": t.prompt, "response": t.reference} for t in make_tasks(24, seed=8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # MTP over packed rows is refused under CP; the sequence-wise balance loss is
    # a per-row statistic that CP ranks see only in part.
    common = ["sft.pack=true", "sft.seq_length=176", "sft.global_batch=4", "sft.micro_batch=2",
              "sft.steps=3", "sft.warmup_steps=0", f"sft.data_path={data}",
              "model.mtp_num_layers=0", "model.aux_loss_coeff=0.0", "checkpoint.dir=null"]
    single = _losses(1, [*common, f"out_dir={tmp_path / 'one'}"])
    split = _losses(2, [*common, "parallel.cp=2", f"out_dir={tmp_path / 'cp2'}"])
    print(f"losses: one process {single}, CP2 {split}")
    assert len(single) == 3
    assert split == pytest.approx(single, abs=2e-4)  # printed to 4 decimals
    assert single[-1] < single[0] - 0.5
