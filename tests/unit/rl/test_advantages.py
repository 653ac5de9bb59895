"""Advantage estimators and overlong shaping, against loops and by hand."""

from __future__ import annotations

import math

import pytest
import torch

from moerl.rl.advantages import (
    discounted_returns,
    gae,
    group_normalized,
    last_token_rewards,
    masked_whiten,
    overlong_penalty,
    reinforce_plus_plus,
    rloo,
)

F64 = torch.float64


def test_group_normalized_by_hand() -> None:
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]], dtype=F64)
    a = group_normalized(r, eps=0.0 + 1e-12)
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    torch.testing.assert_close(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=F64) / s)
    torch.testing.assert_close(a[1], torch.zeros(4, dtype=F64))  # all-equal: no signal
    torch.testing.assert_close(
        group_normalized(r, scale_by_std=False)[0],
        torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=F64),
    )
    with pytest.raises(ValueError, match=">= 2 samples"):
        group_normalized(torch.ones(3, 1))


@pytest.mark.parametrize("seed", range(3))
def test_rloo_equals_leave_one_out_loop(seed: int) -> None:
    r = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed), dtype=F64)
    expected = torch.empty_like(r)
    for g in range(4):
        for j in range(5):
            others = [r[g, k] for k in range(5) if k != j]
            expected[g, j] = r[g, j] - sum(others) / len(others)
    torch.testing.assert_close(rloo(r), expected)


def _ref_gae(
    rew: torch.Tensor, val: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    out = torch.zeros_like(val)
    for i in range(val.shape[0]):
        steps = [t for t in range(val.shape[1]) if mask[i, t]]
        adv_next, v_next = 0.0, 0.0
        for t in reversed(steps):
            delta = float(rew[i, t]) + gamma * v_next - float(val[i, t])
            adv_next = delta + gamma * lam * adv_next
            v_next = float(val[i, t])
            out[i, t] = adv_next
    return out


@pytest.mark.parametrize("seed", range(4))
def test_gae_equals_reference_loop(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rew = torch.randn(5, 9, generator=g, dtype=F64)
    val = torch.randn(5, 9, generator=g, dtype=F64)
    mask = torch.rand(5, 9, generator=g) > 0.35  # holes mid-sequence: environment tokens
    mask[:, 0] = True
    adv, ret = gae(rew, val, mask, gamma=0.97, lam=0.9)
    torch.testing.assert_close(adv, _ref_gae(rew, val, mask, 0.97, 0.9))
    torch.testing.assert_close(ret, torch.where(mask, adv + val, 0.0))


def test_gae_with_gamma_lambda_one_is_return_minus_value() -> None:
    rew = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    val = torch.tensor([[0.2, 0.5, 0.9]], dtype=F64)
    adv, _ = gae(rew, val, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, 1.0 - val)


def test_discounted_returns_skip_masked_tokens() -> None:
    r = torch.tensor([[1.0, 100.0, 2.0, 4.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 1, 1]])
    out = discounted_returns(r, mask, gamma=0.5)
    # t=3: 4; t=2: 2 + 0.5*4 = 4; t=1 masked: 0; t=0: 1 + 0.5*4 = 3
    torch.testing.assert_close(out, torch.tensor([[3.0, 0.0, 4.0, 4.0]], dtype=F64))


def test_reinforce_plus_plus_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0], dtype=F64)
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])  # prompt token, then responses
    kl = torch.full((2, 4), 0.5, dtype=F64)
    torch.testing.assert_close(
        last_token_rewards(rewards, mask),
        torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 0]], dtype=F64),
    )
    adv = reinforce_plus_plus(rewards, mask, kl=kl, kl_coef=0.1)
    # token rewards: row 0: -0.05, 1 - 0.05; row 1: -0.05 x 3. Returns (gamma = 1) of the
    # loss tokens in order: 0.9, 0.95 | -0.15, -0.10, -0.05; whitened over all five.
    flat = torch.tensor([0.9, 0.95, -0.15, -0.10, -0.05], dtype=F64)
    want = (flat - flat.mean()) / (flat.std() + 1e-8)
    torch.testing.assert_close(adv[mask.bool()], want)
    assert (adv[~mask.bool()] == 0).all()
    assert adv[mask.bool()].mean().abs() < 1e-12


def test_masked_whiten_ignores_masked_entries() -> None:
    x = torch.tensor([[1.0, 1000.0, 3.0]], dtype=F64)
    out = masked_whiten(x, torch.tensor([[1, 0, 1]]))
    s = math.sqrt(2.0)  # unbiased std of [1, 3]
    torch.testing.assert_close(out, torch.tensor([[-1 / s, 0.0, 1 / s]], dtype=F64))


# --- dynamic sampling --------------------------------------------------------------------

# --- overlong shaping ----------------------------------------------------------------------


def test_overlong_penalty_boundaries() -> None:
    max_len, buffer = 100, 20  # ramp from 80 to 100
    lengths = torch.tensor([0, 79, 80, 81, 90, 99, 100, 101, 500])
    out = overlong_penalty(lengths, max_len, buffer)
    expected = [0.0, 0.0, 0.0, -1 / 20, -0.5, -19 / 20, -1.0, -1.0, -1.0]
    torch.testing.assert_close(out, torch.tensor(expected))
    torch.testing.assert_close(overlong_penalty(lengths, max_len, buffer, factor=0.5), 0.5 * out)
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 10, 0)
