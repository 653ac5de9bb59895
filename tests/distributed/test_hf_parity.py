"""An HF DeepSeek-V3 imported under TP2 and EP2 gives `transformers`' logits and
exports back to the same tensors.

The parent builds a tiny DeepSeek-V3 with transformers (no downloads) and computes
its logits; each layout runs `hf_parity_worker.py` under torchrun (gloo), which
imports the checkpoint, writes the Megatron logits and exports the model again.
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
LAYOUTS = {"tp2": {"tp": 2}, "ep2": {"ep": 2}}


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
    args = ["--hf", str(hf_dir), "--out", str(tmp_path), "--layout", json.dumps(LAYOUTS[name])]
    run_worker(WORKER, 2, args)
    got = torch.load(tmp_path / "logits.pt")
    diff = (got - want).abs().max().item()
    print(f"{name}: max |megatron - transformers| logit = {diff:.2e}")
    assert diff < LOGIT_TOLERANCE
    before, after = load_file(hf_dir / "model.safetensors"), load_file(
        tmp_path / "hf" / "model.safetensors")
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before), [
        k for k in before if not torch.equal(after[k], before[k])]
