"""Rollout-vs-trainer importance correction: TIS and MIS, token and sequence level."""

from __future__ import annotations

import math

import pytest
import torch

from moerl.rl.losses import (
    Denominator,
    ISCorrectionConfig,
    PolicyLossInputs,
    PPOClipConfig,
    build_objective,
    global_denominator,
)
from moerl.rl.losses.is_correction import is_weights
from moerl.rl.objective_config import ISLevel, ISMode


def _logs(rhos: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """old, rollout logprobs with exp(old - rollout) == rhos."""
    rollout = torch.full((len(rhos), len(rhos[0])), -2.0, dtype=torch.float64)
    return rollout + torch.tensor(rhos, dtype=torch.float64).log(), rollout


def _w(rhos: list[list[float]], mask: list[list[int]], **cfg: object) -> tuple[torch.Tensor, dict]:
    old, rollout = _logs(rhos)
    m = torch.tensor(mask)
    return is_weights(old, rollout, m, ISCorrectionConfig(**cfg), global_denominator([m]))


TOKEN_RHOS = [[0.5, 1.5, 3.0, 5.0]]
TOKEN_MASK = [[1, 1, 1, 0]]


def test_token_tis_truncates() -> None:
    w, m = _w(TOKEN_RHOS, TOKEN_MASK, mode="tis", level="token", upper=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0, 0.0]], dtype=torch.float64))
    assert m["is/changed_frac"].item() == pytest.approx(1 / 3)
    assert m["is/dropped_frac"].item() == 0
    assert m["is/raw_weight_max"].item() == pytest.approx(3.0)  # the masked 5.0 is ignored


def test_token_mis_masks_out_of_range() -> None:
    w, m = _w(TOKEN_RHOS, TOKEN_MASK, mode="mis", level="token", lower=0.6, upper=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.5, 0.0, 0.0]], dtype=torch.float64))
    assert m["is/dropped_frac"].item() == pytest.approx(2 / 3)
    assert m["is/weight_mean"].item() == pytest.approx(1.5 / 3)


SEQ_RHOS = [[2.0, 0.5, 3.0], [1.5, 1.5, 7.0]]
SEQ_MASK = [[1, 1, 1], [1, 1, 0]]  # products 3.0 and 2.25


def test_sequence_tis_uses_the_product_of_ratios() -> None:
    w, _ = _w(SEQ_RHOS, SEQ_MASK, mode="tis", level="sequence", upper=2.5)
    expected = torch.tensor([[2.5, 2.5, 2.5], [2.25, 2.25, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected)


def test_sequence_mis_drops_whole_sequences() -> None:
    w, m = _w(SEQ_RHOS, SEQ_MASK, mode="mis", level="sequence", upper=2.5)
    expected = torch.tensor([[0.0, 0.0, 0.0], [2.25, 2.25, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected)
    assert m["is/dropped_frac"].item() == pytest.approx(3 / 5)


def test_geometric_level_is_the_length_normalised_ratio() -> None:
    w, _ = _w(SEQ_RHOS, SEQ_MASK, mode="tis", level="geometric", upper=10.0)
    g0, g1 = 3.0 ** (1 / 3), 1.5
    expected = torch.tensor([[g0, g0, g0], [g1, g1, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected)


def test_weights_carry_no_gradient_and_mismatch_kl() -> None:
    old = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    m = torch.ones(1, 2)
    d = Denominator(2, 1)
    w, metrics = is_weights(old, old.detach(), m, ISCorrectionConfig(), d)
    assert not w.requires_grad
    assert metrics["is/mismatch_kl"].item() == 0
    _, metrics = is_weights(old, old.detach() - math.log(2), m, ISCorrectionConfig(), d)
    # rho = 2 on both tokens: k3 = (rho - 1) - log rho
    assert metrics["is/mismatch_kl"].item() == pytest.approx(1 - math.log(2))


def test_correction_scales_the_policy_gradient_per_token() -> None:
    g = torch.Generator().manual_seed(0)
    lp = (-1 + 0.2 * torch.randn(3, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = lp.detach() + 0.1 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    rollout = old + 0.5 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5)
    d = global_denominator([mask])
    inputs = PolicyLossInputs(lp, old, adv, mask, rollout_logprobs=rollout)
    tis = ISCorrectionConfig(upper=1.3)
    plain, _ = build_objective("ppo_clip")(inputs, d)
    corrected, _ = build_objective("ppo_clip", PPOClipConfig(is_correction=tis))(inputs, d)
    (g_plain,) = torch.autograd.grad(plain, lp)
    (g_corr,) = torch.autograd.grad(corrected, lp)
    w = (old - rollout).exp().clamp(max=1.3)
    torch.testing.assert_close(g_corr, g_plain * w)
    assert (w < 1.3).any() and (w == 1.3).any()


def test_config_checks() -> None:
    assert ISCorrectionConfig(mode="mis", level="sequence").mode is ISMode.MASK
    assert ISCorrectionConfig(level="geometric").level is ISLevel.GEOMETRIC
    with pytest.raises(ValueError):
        ISCorrectionConfig(lower=2.0, upper=1.5)
    with pytest.raises(ValueError):
        ISCorrectionConfig(mode="clip")
    lp = torch.zeros(1, 2)
    inputs = PolicyLossInputs(lp, lp, torch.ones(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        build_objective("ppo_clip", PPOClipConfig(is_correction=ISCorrectionConfig()))(
            inputs, Denominator(2, 1)
        )


def test_versions_of_a_partial_rollout_are_reported() -> None:
    # Row 0: an update to v4 landed after two tokens (the last token is masked out);
    # row 1: one version; row 2: padding.
    versions = torch.tensor([[3, 3, 4, 4, 5], [4, 4, 4, -1, -1], [-1, -1, -1, -1, -1]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    old, rollout = _logs([[1.0] * 5] * 3)
    _, m = is_weights(old, rollout, mask, ISCorrectionConfig(), global_denominator([mask]),
                      versions)
    assert float(m["is/versions_per_seq_max"]) == 2.0
    assert float(m["is/older_version_frac"]) == pytest.approx(2 / 7)
    _, same = is_weights(old, rollout, mask, ISCorrectionConfig(), global_denominator([mask]),
                         torch.where(mask.bool(), 4, -1))
    assert float(same["is/versions_per_seq_max"]) == 1.0
    assert float(same["is/older_version_frac"]) == 0.0


def test_packed_samples_carry_their_token_versions() -> None:
    from moerl.data.rl_batch import RLSample, pack, plan_microbatches

    spanning = RLSample(torch.tensor([1, 2]), torch.tensor([5, 6, 7]), advantage=1.0,
                        weight_version=3, token_versions=torch.tensor([3, 4, 4]))
    whole = RLSample(torch.tensor([1]), torch.tensor([8, 9]), advantage=1.0, weight_version=4)
    (mb,) = pack([spanning, whole], plan_microbatches([spanning, whole], token_budget=16))
    assert mb.token_versions is not None
    assert mb.token_versions[0].tolist() == [-1, 3, 4, 4]  # aligned with the loss mask
    assert mb.token_versions[1].tolist() == [4, 4, -1, -1]
    assert (mb.token_versions >= 0).tolist() == mb.loss_mask.bool().tolist()
