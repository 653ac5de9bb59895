"""A whole-model weight file, written by one trainer rank, read by a rollout server that
splits the model (TP2 with EP2 on two ranks): every tensor it holds equals what it
reads from the sharded format of the same weights (whole_weights_worker.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from worker_launch import run_worker

WORKER = Path(__file__).with_name("whole_weights_worker.py")


@pytest.mark.distributed
def test_a_split_server_reads_its_slices_of_the_whole_file(tmp_path: Path) -> None:
    run_worker(WORKER, 1, ["--dir", str(tmp_path)])
    run_worker(WORKER, 2, ["--dir", str(tmp_path), "--layout", json.dumps({"tp": 2, "ep": 2})])
    result = json.loads((tmp_path / "read.json").read_text())
    assert result["compared"] > 50 and result["differ"] == 0, result
