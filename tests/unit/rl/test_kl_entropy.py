"""KL estimators and entropy."""

from __future__ import annotations

import math

import pytest
import torch

from moerl.rl.losses.entropy import entropy_from_logits
from moerl.rl.losses.kl import kl_estimate, kl_penalty
from moerl.rl.objective_config import KLEstimator


def test_estimators_by_hand() -> None:
    lp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])  # log r = log(ref / pi) = -log 2
    l2 = math.log(2)
    assert kl_estimate(lp, ref, KLEstimator.K1).item() == pytest.approx(l2)
    assert kl_estimate(lp, ref, KLEstimator.K2).item() == pytest.approx(0.5 * l2**2)
    assert kl_estimate(lp, ref, KLEstimator.K3).item() == pytest.approx(0.5 - 1 + l2)


def test_k3_gradient_and_sign() -> None:
    lp = torch.linspace(-3, 0, 7, dtype=torch.float64)[None].requires_grad_(True)
    ref = torch.full_like(lp, -1.5)
    k3 = kl_estimate(lp, ref, KLEstimator.K3)
    assert (k3 >= 0).all()
    (g,) = torch.autograd.grad(k3.sum(), lp)
    torch.testing.assert_close(g, 1 - torch.exp(ref - lp.detach()))  # d/dlogpi = 1 - r


@pytest.mark.parametrize("seed", range(2))
def test_k1_and_k3_are_unbiased_for_sampled_tokens(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    log_p = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    log_q = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    true_kl = (log_p.exp() * (log_p - log_q)).sum().item()
    tokens = torch.multinomial(log_p.exp(), 200_000, replacement=True, generator=g)
    lp, ref = log_p[tokens][None], log_q[tokens][None]
    for est in (KLEstimator.K1, KLEstimator.K3):
        assert kl_estimate(lp, ref, est, clamp=None).mean().item() == pytest.approx(
            true_kl, abs=0.02
        )


def test_kl_penalty_is_detached_and_masked() -> None:
    lp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -9.0]])
    pen = kl_penalty(lp, ref, torch.tensor([[1, 1, 0]]))
    assert not pen.requires_grad
    torch.testing.assert_close(pen, torch.tensor([[0.5, -1.0, 0.0]]))  # k1 = logpi - logref


def test_entropy_from_logits() -> None:
    v = 7
    uniform = torch.zeros(2, 3, v)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(v)))
    banned = torch.tensor([[[0.0, float("-inf"), float("-inf")]]], requires_grad=True)
    h = entropy_from_logits(banned)
    (g,) = torch.autograd.grad(h.sum(), banned)
    assert h.item() == 0 and torch.isfinite(g).all()
    logits = torch.randn(4, 5, v, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
