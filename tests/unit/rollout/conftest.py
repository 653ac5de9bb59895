"""A tiny MoE on one CPU process, and the plain loops the engine is checked against."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from moerl.data.tokenizer import ByteTokenizer
from moerl.models.arch import TINY
from moerl.rollout.engine import EngineOptions, MegatronEngine, build_engine

SEED = 1234


@pytest.fixture(scope="module")
def engine() -> Iterator[MegatronEngine]:
    """Per module, not per package: under pytest-xdist a package fixture lives until the
    worker ends, and its process group would outlast the package into other tests."""
    from moerl.parallel.groups import destroy_parallel

    torch.set_num_threads(1)  # the machine is shared; small matmuls gain nothing from more
    built = build_engine("tiny", ByteTokenizer(), seed=SEED, options=EngineOptions(max_batch=8))
    yield built
    destroy_parallel()


@pytest.fixture(scope="module")
def model(engine: MegatronEngine) -> GPTModel:
    return engine.model


def full_logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """[B, S] -> [B, S, V] logits of one uncached forward (what the trainer computes)."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.inference_mode():
        return model(tokens, positions, None).float()


def greedy_no_cache(model: GPTModel, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence for every new token."""
    tokens = torch.tensor([prompt])
    for _ in range(steps):
        nxt = full_logits(model, tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[0, len(prompt):].tolist()


VOCAB = TINY.vocab_size


@pytest.fixture(scope="module")
def other_model(engine: MegatronEngine) -> GPTModel:
    """The same architecture with other weights (a different seed)."""
    from moerl.models.build import build_model
    from moerl.parallel.layout import ParallelLayout

    torch.manual_seed(SEED + 1)
    (built,) = build_model(TINY, ParallelLayout())
    built.eval()
    return built


@pytest.fixture(scope="module")
def other_weights(other_model: GPTModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moerl.models.weights import save_weights

    return save_weights([other_model], tmp_path_factory.mktemp("weights") / "v1")
