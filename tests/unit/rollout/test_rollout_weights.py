"""Weight updates on the engine: new outputs and version, failed loads undone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import greedy_no_cache
from megatron.core.models.gpt import GPTModel

from moerl.rollout.engine import MegatronEngine, WeightLoadError
from moerl.rollout.types import GenerationRequest, SamplingParams

PROMPT = list(b"weights")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _greedy(engine: MegatronEngine) -> tuple[tuple[int, ...], int]:
    (sample,) = engine.generate([GenerationRequest(tuple(PROMPT), GREEDY)])[0]
    return sample.token_ids, sample.weight_version


def _corrupt_copy(weights: Path, into: Path) -> Path:
    broken = shutil.copytree(weights, into / "broken")
    for data in broken.glob("*.distcp"):
        data.write_bytes(data.read_bytes()[:100])  # truncated mid-write, marker still present
    return broken


def test_update_changes_outputs_and_failed_update_is_undone(
    engine: MegatronEngine, model: GPTModel, other_model: GPTModel, other_weights: Path,
    tmp_path: Path,
) -> None:
    original = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    start_version = engine.weight_version
    before, _ = _greedy(engine)
    broken = _corrupt_copy(other_weights, tmp_path)
    try:
        with pytest.raises(WeightLoadError):
            engine.load_weights(broken, 3)
        assert _greedy(engine) == (before, start_version)  # random init restored from memory
        assert engine.broken is None

        engine.load_weights(other_weights, 4)
        after, version = _greedy(engine)
        assert version == 4 and after != before
        assert list(after) == greedy_no_cache(other_model, PROMPT, 8)

        with pytest.raises(WeightLoadError):
            engine.load_weights(broken, 5)
        assert _greedy(engine) == (after, 4)  # restored by re-reading version 4's checkpoint
        with pytest.raises(FileNotFoundError):
            engine.load_weights(tmp_path / "missing", 6)
    finally:
        model.load_state_dict(original, strict=False)
        engine._version, engine._weights_path = start_version, None
