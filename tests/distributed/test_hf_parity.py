"""An HF DeepSeek-V3 imported under TP2, EP2 and TP2 x EP2 gives `transformers'`
logits, each rank reading only its slices, and exports back to the same tensors,
every rank writing its own files.

The parent builds a tiny DeepSeek-V3 with transformers (no downloads) and computes
its logits; each layout runs `hf_parity_worker.py` on its ranks (gloo), which imports
the checkpoint (counting the bytes each rank reads, and checking every tensor against
the import that reads whole tensors), writes the Megatron logits and exports the model
again. transformers loads the export (its index and every rank's files) and gives the
original logits exactly. `benchmarks/hf_import_export.py` runs the same at 1B.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_parity_worker import tiny_hf_checkpoint, tokens
from worker_launch import run_worker

WORKER = Path(__file__).with_name("hf_parity_worker.py")
LOGIT_TOLERANCE = 1e-4
LAYOUTS = {"tp2": ({"tp": 2}, 2), "ep2": ({"ep": 2}, 2), "tp2ep2": ({"tp": 2, "ep": 2}, 4)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    from transformers import DeepseekV3ForCausalLM

    hf_dir = tiny_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tiny")
    model = DeepseekV3ForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return hf_dir, model(tokens()).logits


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_import_matches_transformers_and_export_round_trips(
    name: str, reference: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    hf_dir, want = reference
    degrees, ranks = LAYOUTS[name]
    args = ["--hf", str(hf_dir), "--out", str(tmp_path), "--layout", json.dumps(degrees)]
    run_worker(WORKER, ranks, args)
    got = torch.load(tmp_path / "logits.pt")
    diff = (got - want).abs().max().item()
    print(f"{name}: max |megatron - transformers| logit = {diff:.2e}")
    assert diff < LOGIT_TOLERANCE

    before = load_file(hf_dir / "model.safetensors")
    total = sum(t.nbytes for t in before.values())
    imported = json.loads((tmp_path / "import.json").read_text())
    print(f"{name}: bytes read per rank {[r['bytes_read'] for r in imported]} of {total}")
    assert all(r["same_as_whole"] for r in imported)
    # A rank reads exactly the bytes of the shard it holds: its half of what is split
    # (vocabulary, attention heads, MLPs, or experts) and the replicated rest.
    assert all(r["bytes_read"] == r["held_bytes"] for r in imported)
    if name == "tp2ep2":
        assert all(r["bytes_read"] < 0.6 * total for r in imported)

    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1  # written by more than one rank
    after = {k: v for file in set(index.values()) for k, v in load_file(out / file).items()}
    assert sorted(after) == sorted(before) == sorted(index)
    assert all(torch.equal(after[k], before[k]) for k in before), [
        k for k in before if not torch.equal(after[k], before[k])]
    from transformers import DeepseekV3ForCausalLM

    with torch.no_grad():
        reloaded = DeepseekV3ForCausalLM.from_pretrained(out).eval()(tokens()).logits
    assert torch.equal(reloaded, want)
