"""An asynchronous, fully parallel save on 8 ranks (TP2 EP2 DP4), resumed on 4 (DP2).

- Overlap, shown by structure, not by timing: every rank's write is held at a gate
  until a whole optimizer step has run; the step runs with the write in flight, and
  the checkpoint is published only after the gate opens.
- Memory: each rank's resident memory grows during the save by at most the copy its
  write staged, which is its shard of the checkpoint (about 1/8 of the files, every
  rank writing one), plus a small allowance; a save that gathered whole tensors on one
  rank would stage and write far more there.
- Exactness across layouts: the optimizer state reshards over data parallelism
  (Megatron's dp_reshardable format), so the resumed state is compared, tensor by
  tensor, with the saved one, both written in the layout-free form
  (`checkpoint_worker.canonical`); and step 3 of the resumed run gives step 3's loss.

The step time with a save in flight against one without is a figure, not a test:
`benchmarks/checkpoint_overlap.py`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from worker_launch import run_worker

WORKER = Path(__file__).with_name("checkpoint_worker.py")
# Resident memory a rank may gain beyond its staged copy (allocator and interpreter
# noise; measured under 2 MiB here).
ALLOWANCE = 8 << 20


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, whole (one process, no groups)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    load(state, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    return state


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_async_parallel_save_overlaps_a_step_and_resumes_exactly(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    out = tmp_path / "save.json"
    saved = run_worker(WORKER, 8, ["save", "--root", str(root), "--gate", str(tmp_path / "gate"),
                                   "--canonical", str(tmp_path / "canonical_saved"),
                                   "--out", str(out)], out=out, timeout=800)
    for report in saved:
        assert report["writing_before_step"] and report["writing_after_step"]
        assert not report["published_during_step"]
    assert (root / "latest").read_text() == "step_00000002\n"

    manifest = json.loads((root / "step_00000002" / "manifest.json").read_text())["files"]
    written = [sum(e["size"] for name, e in manifest.items()
                   if name.startswith(f"dist/__{rank}_") and name.endswith(".distcp"))
               for rank in range(8)]
    for rank, report in enumerate(saved):
        print(f"rank {rank}: wrote {written[rank] >> 10} KiB, staged {report['staged'] >> 10}"
              f" KiB, resident memory +{report['extra_rss'] >> 10} KiB during the save")
        assert 0 < report["staged"] <= written[rank]  # the tensors, without torch's framing
        assert written[rank] <= 2 * sum(written) / 8  # every rank writes its share
        assert report["extra_rss"] <= report["staged"] + ALLOWANCE

    out = tmp_path / "resume.json"
    resumed = run_worker(WORKER, 4, ["resume", "--root", str(root),
                                     "--canonical", str(tmp_path / "canonical_resumed"),
                                     "--out", str(out)], out=out, timeout=800)
    before, after = tensors(tmp_path / "canonical_saved"), tensors(tmp_path / "canonical_resumed")
    assert sorted(before) == sorted(after)
    assert any(".exp_avg_sq." in key for key in before)  # the optimizer state is there
    differ = [k for k in before if not torch.equal(before[k], after[k])]
    assert differ == []
    assert resumed[0]["loss"] == pytest.approx(saved[0]["loss"], abs=1e-6)
