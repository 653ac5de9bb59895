"""CPU shims whose Megatron call needs two gloo ranks: each fails with the shim lifted
and gives the right values with it (see tests/unit/test_cpu_shims.py for the rest)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from worker_launch import run_worker

WORKER = Path(__file__).with_name("gloo_shim_worker.py")


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims only without a GPU")
def test_uneven_gather(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    got = run_worker(WORKER, 2, ["--out", str(out)], out)
    print(got)
    assert got["without"].startswith("RuntimeError") and "invalid tensor size" in got["without"]
    assert got["with"] == "ok"
