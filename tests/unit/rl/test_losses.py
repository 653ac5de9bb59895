"""Each objective against hand-computed values and an independent reference gradient."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from moerl.rl.losses import (
    OBJECTIVE_NAMES,
    CISPOConfig,
    DAPOConfig,
    Denominator,
    DrGRPOConfig,
    GRPOConfig,
    GSPOConfig,
    ISCorrectionConfig,
    ObjectiveConfig,
    PolicyLossInputs,
    PPOClipConfig,
    build_objective,
    global_denominator,
    objective_config_class,
)


@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    # Hand-computed values are compared tightly; restored so other modules see fp32.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _inputs(
    ratios: list[float], adv: list[float], mask: list[int] | None = None
) -> PolicyLossInputs:
    """One row whose old logprobs are 0, so pi_theta / pi_old is exactly `ratios`."""
    lp = torch.tensor([ratios]).log().requires_grad_(True)
    m = torch.tensor([mask if mask is not None else [1] * len(ratios)])
    return PolicyLossInputs(lp, torch.zeros_like(lp), torch.tensor([adv]), m)


def _denom(inputs: PolicyLossInputs, norm_len: float | None = None) -> Denominator:
    return global_denominator([inputs.loss_mask], norm_len=norm_len)


def _grad(loss: torch.Tensor, inputs: PolicyLossInputs) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, inputs.logprobs)
    return g[0]


# --- PPO-clip -----------------------------------------------------------------------------

PPO_RATIOS = [1.5, 0.5, 1.1, 0.7, 1.3, 9.0]
PPO_ADV = [1.0, -1.0, 1.0, 1.0, -1.0, 1.0]
PPO_MASK = [1, 1, 1, 1, 1, 0]  # the last token is masked out despite its huge ratio


def test_ppo_clip_by_hand() -> None:
    inputs = _inputs(PPO_RATIOS, PPO_ADV, PPO_MASK)
    loss, m = build_objective("ppo_clip")(inputs, _denom(inputs))
    # per token: clipped high -1.2, clipped low +0.8, -1.1, -0.7 (A>0, r<0.8 not clipped),
    # +1.3 (A<0, r>1.2 not clipped)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.1 - 0.7 + 1.3) / 5)
    # d/dlogpi of -r A is -r A; zero on the two clipped tokens and the masked one
    expected = torch.tensor([0.0, 0.0, -1.1, -0.7, 1.3, 0.0]) / 5
    torch.testing.assert_close(_grad(loss, inputs), expected)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 5)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 5)
    assert m["clip_frac"].item() == pytest.approx(2 / 5)
    assert m["ratio_max"].item() == pytest.approx(1.5)
    assert m["ratio_mean"].item() == pytest.approx(sum(PPO_RATIOS[:5]) / 5)


def test_ppo_clip_matches_reference_min_formula() -> None:
    g = torch.Generator().manual_seed(0)
    lp = (0.4 * torch.randn(6, 9, generator=g)).requires_grad_(True)
    old = torch.zeros(6, 9)
    adv = torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.3).long()
    inputs = PolicyLossInputs(lp, old, adv, mask)
    loss, _ = build_objective("ppo_clip", PPOClipConfig(eps_low=0.15, eps_high=0.25))(
        inputs, _denom(inputs)
    )
    r = lp.exp()
    ref_tok = -torch.minimum(r * adv, r.clamp(0.85, 1.25) * adv)
    ref = (ref_tok * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(*(torch.autograd.grad(x, lp)[0] for x in (loss, ref)))


def test_dual_clip_caps_negative_advantage_loss() -> None:
    inputs = _inputs([4.0, 2.0], [-1.0, -1.0])
    loss, m = build_objective("ppo_clip", PPOClipConfig(dual_clip=3.0))(inputs, _denom(inputs))
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2)
    torch.testing.assert_close(_grad(loss, inputs), torch.tensor([0.0, 2.0 / 2]))
    assert m["clip_frac_dual"].item() == pytest.approx(0.5)


def test_dapo_clip_higher_is_asymmetric() -> None:
    # r = 1.25 with A > 0: PPO (eps 0.2) clips it, DAPO (eps_high 0.28) does not.
    # r = 0.75 with A < 0: both clip it at 1 - eps_low = 0.8.
    inputs = _inputs([1.25, 0.75, 1.3], [1.0, -1.0, 1.0])
    dapo_loss, m = build_objective("dapo", DAPOConfig())(inputs, _denom(inputs))
    ppo_loss, _ = build_objective("ppo_clip")(inputs, _denom(inputs))
    assert dapo_loss.item() == pytest.approx((-1.25 + 0.8 - 1.28) / 3)
    assert ppo_loss.item() == pytest.approx((-1.2 + 0.8 - 1.2) / 3)
    torch.testing.assert_close(_grad(dapo_loss, inputs), torch.tensor([-1.25 / 3, 0.0, 0.0]))
    assert m["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3)


def test_dapo_weights_tokens_not_sequences() -> None:
    # Two sequences of 1 and 3 tokens, all with ratio 1: token-mean gives every token 1/4.
    lp = torch.zeros(2, 3, requires_grad=True)
    inputs = PolicyLossInputs(
        lp, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), torch.tensor([[1, 0, 0], [1, 1, 1]])
    )
    loss, _ = build_objective("dapo")(inputs, _denom(inputs))
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, -torch.tensor([[1, 0, 0], [1, 1, 1]]) / 4.0)


# --- GRPO and Dr.GRPO ---------------------------------------------------------------------


def _random_case(seed: int, b: int = 5, t: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    lp = (-1.0 + 0.3 * torch.randn(b, t, generator=g)).requires_grad_(True)
    old = lp.detach() + 0.2 * torch.randn(b, t, generator=g)
    ref = lp.detach() + 0.5 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t) < lengths[:, None]).long()
    return lp, old, ref, adv, mask


@pytest.mark.parametrize("seed", range(3))
def test_grpo_against_loop_reference(seed: int) -> None:
    lp, old, ref, adv, mask = _random_case(seed)
    inputs = PolicyLossInputs(lp, old, adv, mask, ref_logprobs=ref)
    beta, eps = 0.04, 0.2
    loss, m = build_objective("grpo", GRPOConfig(kl_coef=beta, eps_low=eps, eps_high=eps))(
        inputs, _denom(inputs)
    )
    seq_losses = []
    for i in range(lp.shape[0]):
        terms = []
        for t in range(lp.shape[1]):
            if mask[i, t]:
                r = torch.exp(lp[i, t] - old[i, t])
                surr = -torch.minimum(r * adv[i], r.clamp(1 - eps, 1 + eps) * adv[i])
                k3 = torch.exp(ref[i, t] - lp[i, t]) - (ref[i, t] - lp[i, t]) - 1
                terms.append(surr + beta * k3)
        seq_losses.append(torch.stack(terms).mean())
    reference = torch.stack(seq_losses).mean()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(*(torch.autograd.grad(x, lp)[0] for x in (loss, reference)))
    assert m["kl_ref"].item() > 0


def test_grpo_needs_reference_logprobs_for_its_kl() -> None:
    inputs = _inputs([1.0], [1.0])
    with pytest.raises(ValueError, match="ref_logprobs"):
        build_objective("grpo")(inputs, _denom(inputs))


def test_dr_grpo_constant_denominator() -> None:
    lp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    inputs = PolicyLossInputs(lp, torch.zeros(2, 4), torch.tensor([2.0, -1.0]), mask)
    loss, _ = build_objective("dr_grpo", DrGRPOConfig())(inputs, _denom(inputs, norm_len=4))
    # ratio 1 everywhere: token losses -2 (1 token) and +1 (3 tokens); S * L = 2 * 4
    assert loss.item() == pytest.approx((-2.0 + 3.0) / 8)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, torch.tensor([[-2.0, 0, 0, 0], [1.0, 1.0, 1.0, 0]]) / 8)


# --- GSPO ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_gspo_sequence_ratio_and_gradient(seed: int) -> None:
    lp, old, _, adv, mask = _random_case(seed, b=6)
    inputs = PolicyLossInputs(lp, old, adv, mask)
    eps_low, eps_high = 0.02, 0.025
    loss, m = build_objective("gspo", GSPOConfig(eps_low=eps_low, eps_high=eps_high))(
        inputs, _denom(inputs)
    )
    # Reference: the sequence form, written independently.
    s = torch.stack([torch.exp((lp[i] - old[i])[mask[i].bool()].mean()) for i in range(6)])
    ref_seq = -torch.minimum(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv)
    reference = ref_seq.mean()
    torch.testing.assert_close(loss, reference)
    g = torch.autograd.grad(loss, lp)[0]
    torch.testing.assert_close(g, torch.autograd.grad(reference, lp)[0])
    assert m["seq_ratio_mean"].item() == pytest.approx(s.mean().item())
    # Clipping is per sequence: a clipped sequence has no gradient on any token.
    clipped = ((adv > 0) & (s > 1 + eps_high)) | ((adv < 0) & (s < 1 - eps_low))
    assert clipped.any() and (~clipped).any()
    assert (g[clipped] == 0).all()
    assert (g[~clipped][mask[~clipped].bool()] != 0).all()


# --- CISPO --------------------------------------------------------------------------------


def test_cispo_gradient_is_clipped_weight_times_advantage() -> None:
    ratios, adv = [0.5, 1.1, 2.0, 1.0], [1.0, -2.0, 1.0, -1.0]
    inputs = _inputs(ratios, adv, [1, 1, 1, 0])
    cfg = CISPOConfig(eps_low=0.2, eps_high=0.28)
    loss, m = build_objective("cispo", cfg)(inputs, _denom(inputs))
    w = torch.tensor(ratios).clamp(0.8, 1.28)
    a = torch.tensor(adv)
    lp = torch.tensor(ratios).log()
    mask = torch.tensor([1.0, 1, 1, 0])
    assert loss.item() == pytest.approx((-(w * a * lp) * mask).sum().item() / 3)
    # d/dlogpi_t = -w_t A_t / N; no gradient through w.
    g = _grad(loss, inputs)
    torch.testing.assert_close(g, -w * a * mask / 3)
    # Had the weight not been detached, the gradient would differ (the test can fail).
    lp2 = lp.clone().requires_grad_(True)
    w_live = lp2.exp().clamp(0.8, 1.28)
    (g_live,) = torch.autograd.grad((-(w_live * a * lp2) * mask).sum() / 3, lp2)
    assert (g_live - g).abs().max() > 1e-3
    assert m["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3)


def test_cispo_keeps_gradient_where_ppo_clips() -> None:
    inputs = _inputs([1.5], [1.0])
    ppo, _ = build_objective("ppo_clip")(inputs, _denom(inputs))
    cispo, _ = build_objective("cispo")(inputs, _denom(inputs))
    assert _grad(ppo, inputs).abs().item() == 0
    assert _grad(cispo, inputs).item() == pytest.approx(-1.28)


# --- shared behaviour -------------------------------------------------------------------


@pytest.mark.parametrize("name", OBJECTIVE_NAMES)
def test_padding_values_cannot_poison_loss_or_gradient(name: str) -> None:
    lp, old, ref, adv, mask = _random_case(1)
    ent = torch.rand(lp.shape)
    roll = old + 0.1
    bad = torch.where(mask.bool(), 0.0, float("nan"))
    worse = torch.where(mask.bool(), 0.0, float("-inf"))
    cfg = build_cfg(name)
    denom = global_denominator([mask], norm_len=8)
    clean_in = PolicyLossInputs(lp, old, adv, mask, roll, ref, ent)
    dirty_in = PolicyLossInputs(lp + bad, old + worse, adv, mask, roll + bad, ref + bad, ent + bad)
    clean, _ = build_objective(name, cfg)(clean_in, denom)
    dirty, _ = build_objective(name, cfg)(dirty_in, denom)
    torch.testing.assert_close(dirty, clean)
    g_dirty, g_clean = (torch.autograd.grad(x, lp)[0] for x in (dirty, clean))
    torch.testing.assert_close(g_dirty, g_clean)
    assert (g_clean[~mask.bool()] == 0).all()


def build_cfg(name: str) -> ObjectiveConfig:
    return objective_config_class(name)(
        kl_coef=0.1, entropy_coef=0.01, is_correction=ISCorrectionConfig()
    )


def test_entropy_bonus_and_kl_term_are_added() -> None:
    lp, old, ref, adv, mask = _random_case(2)
    ent = torch.rand(lp.shape, requires_grad=True)
    denom = _denom(PolicyLossInputs(lp, old, adv, mask))
    plain, _ = build_objective("dapo")(PolicyLossInputs(lp, old, adv, mask), denom)
    cfg = DAPOConfig(kl_coef=0.3, entropy_coef=0.05)
    full, m = build_objective("dapo", cfg)(
        PolicyLossInputs(lp, old, adv, mask, ref_logprobs=ref, entropy=ent), denom
    )
    n = mask.sum()
    kl = ((torch.exp(ref - lp) - (ref - lp) - 1) * mask).sum() / n
    h = (ent * mask).sum() / n
    torch.testing.assert_close(full, plain + 0.3 * kl - 0.05 * h)
    (g_ent,) = torch.autograd.grad(full, ent)
    torch.testing.assert_close(g_ent, -0.05 * mask / n)
    assert m["entropy"].item() == pytest.approx(h.item())


def test_registry() -> None:
    for name in OBJECTIVE_NAMES:
        assert callable(build_objective(name))
    with pytest.raises(ValueError, match="unknown objective"):
        build_objective("reinforce")
    with pytest.raises(TypeError, match="DAPOConfig"):
        build_objective("dapo", PPOClipConfig())
    with pytest.raises(ValueError, match="eps_low"):
        PPOClipConfig(eps_low=1.5)


def test_input_shapes_are_checked() -> None:
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logprobs"):
        PolicyLossInputs(lp, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        PolicyLossInputs(lp, lp, torch.zeros(3), torch.ones(2, 3))


def test_approx_kl_metric_is_zero_on_policy_and_positive_off() -> None:
    same = _inputs([1.0, 1.0], [1.0, -1.0])
    _, m = build_objective("ppo_clip")(same, _denom(same))
    assert m["approx_kl"].item() == 0
    moved = _inputs([2.0, 0.5], [1.0, -1.0])
    _, m = build_objective("ppo_clip")(moved, _denom(moved))
    # k3 with r = pi_theta / pi_old: (r - 1) - log r
    expected = ((2 - 1 - math.log(2)) + (0.5 - 1 - math.log(0.5))) / 2
    assert m["approx_kl"].item() == pytest.approx(expected)
