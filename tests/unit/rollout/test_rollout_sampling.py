"""Pure maths of the batched sampler: filters, greedy, seeds, logprob modes."""

from __future__ import annotations

import torch

from moerl.rollout.sampling import RowSampling, choose_tokens
from moerl.rollout.types import SamplingParams


def _rows(count: int, seed: int = 0, **kwargs: object) -> list[RowSampling]:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    return [RowSampling.make(params, seed, i) for i in range(count)]


def test_greedy_and_top_k_one_are_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    for rows in (_rows(6, temperature=0), _rows(6, temperature=2.0, top_k=1),
                 _rows(6, temperature=1.0, top_p=1e-6)):
        tokens, _ = choose_tokens(logits, rows)
        assert torch.equal(tokens, logits.argmax(-1))


def test_filters_keep_only_allowed_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]]).repeat(400, 1)
    top2, _ = choose_tokens(logits, _rows(400, top_k=2))
    assert set(top2.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # 0.64, 0.24, 0.09, ...: p=0.8 keeps ids 0 and 1
    nucleus, _ = choose_tokens(logits, _rows(400, top_p=0.8))
    assert set(nucleus.tolist()) == {0, 1} and probs[:2].sum() >= 0.8


def test_sampling_follows_the_tempered_distribution() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0]]).repeat(6000, 1)
    tokens, _ = choose_tokens(logits, _rows(6000, seed=3, temperature=0.5))
    freq = torch.bincount(tokens, minlength=3).float() / 6000
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.5, -1), atol=0.02)


def test_a_rows_draw_depends_only_on_its_seed() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    alone, _ = choose_tokens(logits[2:3], [RowSampling.make(SamplingParams(), 9, 2)])
    batch, _ = choose_tokens(logits, _rows(4, seed=9))
    assert batch[2] == alone[0]
    other, _ = choose_tokens(logits.repeat(8, 1), _rows(32, seed=10))
    same, _ = choose_tokens(logits.repeat(8, 1), _rows(32, seed=10))
    assert torch.equal(other, same)


def test_logprob_modes() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    tokens, policy = choose_tokens(logits, _rows(3, temperature=0.5, top_k=3))
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(policy, expected)  # temperature 1, no top-k renormalisation
    tokens, tempered = choose_tokens(logits, _rows(3, temperature=0.5, logprob_mode="sampling"))
    expected = torch.log_softmax(logits / 0.5, -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(tempered, expected)
