"""GAE in the update (`rl.gae_returns`) on packed micro-batches, and the formulas of the
clipped value loss and the explained variance: the same numbers as the reference
functions (`advantages.gae`, a direct recursion, numpy's variances), whitening and
metrics over the whole step rather than per micro-batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moerl.data.rl_batch import RLMicroBatch, RLSample, pack, plan_microbatches
from moerl.rl.advantages import gae, masked_whiten
from moerl.rl.gae_returns import gae_advantages, row_rewards
from moerl.rl.losses import Denominator, global_denominator
from moerl.rl.losses.value import clipped_value_loss


def _samples(n: int, seed: int = 0, env_gap: bool = False) -> list[RLSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 4 + i % 4
        mask = None
        if env_gap and i % 2:  # an environment turn inside the completion: no loss there
            mask = torch.ones(length)
            mask[1:3] = 0.0
        out.append(RLSample(torch.tensor([1, 2, 3]), torch.randint(5, 50, (length,), generator=gen),
                            advantage=0.0, reward=float(i % 3) - 0.5, loss_mask=mask,
                            rollout_logprobs=-torch.rand(length, generator=gen), group_id=i // 2))
    return out


def _like(mb: RLMicroBatch, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(mb.loss_mask.shape, generator=torch.Generator().manual_seed(seed))


def _step(samples: list[RLSample], budget: int, kl_coef: float = 0.0, gamma: float = 0.9,
          lam: float = 0.8) -> tuple[list[RLMicroBatch], list[torch.Tensor], list[RLMicroBatch],
                                     list[torch.Tensor], dict[str, float]]:
    micro = pack(samples, plan_microbatches(samples, token_budget=budget))
    values = [_like(mb, 10 + k) for k, mb in enumerate(micro)]
    old = [-_like(mb, 20 + k).abs() for k, mb in enumerate(micro)]
    ref = [-_like(mb, 30 + k).abs() for k, mb in enumerate(micro)]
    rewards = [row_rewards(mb, samples) for mb in micro]
    out, returns, metrics = gae_advantages(micro, values, rewards, old, ref, kl_coef, gamma, lam,
                                           None)
    return micro, values, out, returns, metrics


@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_one_micro_batch_equals_the_formula(kl_coef: float) -> None:
    samples = _samples(5)
    micro, values, (out,), (ret,), metrics = _step(samples, 4096, kl_coef)
    (mb,) = micro
    rows = mb.loss_mask.bool().any(dim=-1)
    assert int(rows.sum()) == len(samples) < rows.numel()  # the rest are padding rows
    old, ref = -_like(mb, 20).abs(), -_like(mb, 30).abs()
    # r_t: the sample's reward on its last completion token, the KL penalty on each
    token_r = torch.zeros_like(mb.loss_mask)
    for row, i in enumerate(mb.sample_index):
        p, c = samples[i].prompt_ids.numel(), samples[i].completion_ids.numel()
        token_r[row, p - 2 + c] = samples[i].reward
    token_r -= kl_coef * (old - ref) * mb.loss_mask
    adv, want_ret = gae(token_r[rows], values[0][rows], mb.loss_mask[rows], 0.9, 0.8)
    torch.testing.assert_close(ret[rows], want_ret)
    torch.testing.assert_close(out.advantages[rows], masked_whiten(adv, mb.loss_mask[rows]))
    assert not out.advantages[~rows].any() and not ret[~rows].any()
    picked = adv[mb.loss_mask[rows].bool()]
    assert metrics["advantages_mean"] == pytest.approx(float(picked.mean()), abs=1e-6)
    assert metrics["advantages_std"] == pytest.approx(float(picked.std()), abs=1e-6)
    penalty = kl_coef * ((old - ref) * mb.loss_mask).sum() / mb.loss_mask.sum()
    assert metrics["kl_in_reward"] == pytest.approx(float(penalty), abs=1e-6)


def test_masked_tokens_are_skipped_by_the_recursion() -> None:
    """An environment turn inside a completion neither earns nor breaks credit: A_t of the
    token before it bootstraps from the next *loss* token's value."""
    samples = _samples(4, env_gap=True)
    micro, values, _, (ret,), _ = _step(samples, 4096, gamma=0.9, lam=0.8)
    (mb,) = micro
    row = mb.sample_index.index(1)  # sample 1 has the gap
    keep = mb.loss_mask[row].nonzero().flatten().tolist()
    v = values[0][row]
    a_next, v_next, want = 0.0, 0.0, {}
    for j, t in reversed(list(enumerate(keep))):
        r = samples[1].reward if j == len(keep) - 1 else 0.0
        a_next = r + 0.9 * v_next - float(v[t]) + 0.9 * 0.8 * a_next
        v_next = float(v[t])
        want[t] = a_next + float(v[t])
    for t, g in want.items():
        assert float(ret[row, t]) == pytest.approx(g, abs=1e-5)


def test_whitening_and_metrics_span_every_micro_batch_of_the_step() -> None:
    samples = _samples(12)
    micro, values, out, returns, metrics = _step(samples, 32)
    assert len(micro) > 1
    keep = [mb.loss_mask.bool() for mb in micro]
    a = torch.cat([mb.advantages[k] for mb, k in zip(out, keep, strict=True)])
    assert abs(float(a.mean())) < 1e-5 and float(a.std()) == pytest.approx(1.0, rel=1e-4)
    g = np.concatenate([r[k].numpy() for r, k in zip(returns, keep, strict=True)]).astype(float)
    v = np.concatenate([x[k].numpy() for x, k in zip(values, keep, strict=True)]).astype(float)
    # explained variance = 1 - Var[G - V] / Var[G] over the step's loss tokens
    assert metrics["explained_variance"] == pytest.approx(1 - np.var(g - v) / np.var(g), abs=1e-5)
    assert metrics["returns_mean"] == pytest.approx(g.mean(), abs=1e-5)
    assert metrics["values_mean"] == pytest.approx(v.mean(), abs=1e-5)


def test_explained_variance_is_one_for_perfect_values_and_zero_for_none() -> None:
    samples = _samples(6)
    micro = pack(samples, plan_microbatches(samples, token_budget=4096))
    rewards = [row_rewards(mb, samples) for mb in micro]
    zeros = [torch.zeros_like(mb.loss_mask) for mb in micro]
    none = [None] * len(micro)
    _, returns, blind = gae_advantages(micro, zeros, rewards, none, none, 0.0, 1.0, 1.0, None)
    assert blind["explained_variance"] == pytest.approx(0.0, abs=1e-9)
    # With lambda = 1 the returns do not depend on V: feed them back as values.
    _, again, seeing = gae_advantages(micro, returns, rewards, none, none, 0.0, 1.0, 1.0, None)
    torch.testing.assert_close(again[0], returns[0])
    assert seeing["explained_variance"] == pytest.approx(1.0, abs=1e-6)


def _value_inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(3, 6, generator=gen)
    v_old = v + 0.5 * torch.randn(3, 6, generator=gen)
    r = torch.randn(3, 6, generator=gen)
    mask = (torch.rand(3, 6, generator=gen) > 0.3).float()
    return v, v_old, r, mask


def test_clipped_value_loss_formula_and_gradient() -> None:
    v, v_old, r, mask = _value_inputs()
    v = v.requires_grad_()
    eps = 0.2
    denom = global_denominator([mask])
    loss, metrics = clipped_value_loss(v, v_old, r, mask, eps, denom)
    v_clip = v_old + (v.detach() - v_old).clamp(-eps, eps)
    unclipped, clipped = 0.5 * (v.detach() - r) ** 2, 0.5 * (v_clip - r) ** 2
    want = (torch.maximum(unclipped, clipped) * mask).sum() / mask.sum()
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-6)
    took_clip = (clipped > unclipped) & mask.bool()
    assert 0 < int(took_clip.sum()) < int(mask.sum())  # both branches exercised
    assert float(metrics["value_clip_frac"]) == pytest.approx(
        float(took_clip.sum() / mask.sum()), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, v)
    # dL/dV: (V - R) / N on unclipped tokens; 0 where the clipped error wins (V outside
    # the window there) and off the mask.
    want_grad = torch.where(took_clip | ~mask.bool(), 0.0, (v.detach() - r) / mask.sum())
    inside = (v.detach() - v_old).abs() < eps
    want_grad = torch.where(took_clip & inside, (v_clip - r) / mask.sum(), want_grad)
    torch.testing.assert_close(grad, want_grad)


def test_unclipped_value_loss_and_the_global_denominator() -> None:
    v, v_old, r, mask = _value_inputs(1)
    denom = Denominator(num_tokens=float(mask.sum()), num_seqs=3.0)
    whole, _ = clipped_value_loss(v, v_old, r, mask, None, denom)
    assert float(whole) == pytest.approx(float((0.5 * (v - r) ** 2 * mask).sum() / mask.sum()))
    # Row by row (micro-batches of one row) with the global count adds up to the whole.
    parts = [clipped_value_loss(v[i:i + 1], v_old[i:i + 1], r[i:i + 1], mask[i:i + 1], None,
                                denom)[0] for i in range(3)]
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-6)
    # Padding may hold anything: nan off the mask changes nothing.
    v_nan = torch.where(mask.bool(), v, torch.full_like(v, float("nan")))
    again, _ = clipped_value_loss(v_nan, v_old, r, mask, 0.2, denom)
    assert torch.isfinite(again)
