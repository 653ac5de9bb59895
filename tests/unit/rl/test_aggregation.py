"""Aggregation modes and their global denominators.

The central property: a global batch split into micro-batches (gradient accumulation)
and data-parallel shards, each micro-batch's loss computed with the global
denominator, summed, gives the gradient of the one big batch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from moerl.rl.losses import (
    OBJECTIVE_NAMES,
    AggregationMode,
    Denominator,
    ISCorrectionConfig,
    PolicyLossInputs,
    aggregate,
    build_objective,
    global_denominator,
    objective_config_class,
)
from moerl.rl.losses.entropy import entropy_from_logits

MODES = list(AggregationMode)

# --- hand-computed values ---------------------------------------------------------------

X = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [7.0, 8.0, 100.0, 9.0]])
M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 1, 0, 1]])
# row sums over the mask: 6, 4, 17 (total 27); row token counts 3, 1, 2 (total 6)
D = Denominator(num_tokens=6, num_seqs=3, norm_len=4)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (AggregationMode.TOKEN_MEAN, 27 / 6),
        (AggregationMode.SEQ_MEAN_TOKEN_MEAN, (6 / 3 + 4 / 1 + 17 / 2) / 3),
        (AggregationMode.SEQ_MEAN_TOKEN_SUM, 27 / 3),
        (AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM, 27 / (3 * 4)),
    ],
)
def test_modes_by_hand(mode: AggregationMode, expected: float) -> None:
    assert aggregate(X, M, mode, D).item() == pytest.approx(expected)


def test_masked_inf_and_nan_do_not_leak() -> None:
    x = X.clone().requires_grad_(True)
    poisoned = torch.where(M.bool(), x, torch.tensor(float("nan")))
    poisoned = torch.where(torch.arange(4) == 3, torch.tensor(float("inf")), poisoned)
    m = M.clone()
    m[0, 3] = 0
    m[2, 3] = 0  # the inf column is now masked everywhere
    out = aggregate(poisoned, m, AggregationMode.TOKEN_MEAN, D)
    out.backward()
    assert torch.isfinite(out)
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert (x.grad[~m.bool()] == 0).all()


def test_denominator_counts_and_errors() -> None:
    masks = [M, torch.zeros(2, 7, dtype=torch.long), torch.ones(1, 2)]
    d = global_denominator(masks, norm_len=16)
    assert (d.num_tokens, d.num_seqs, d.norm_len) == (8.0, 4.0, 16)  # padding rows not counted
    with pytest.raises(ValueError, match="no loss tokens"):
        global_denominator([torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(X, M, AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM, Denominator(6, 3))


def test_denominator_all_reduce_over_a_group() -> None:
    started = not dist.is_initialized()  # another module's one-process group may be up
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = global_denominator([M], group=dist.new_group([0], backend="gloo"))
    finally:
        if started:
            dist.destroy_process_group()
    assert (d.num_tokens, d.num_seqs) == (6.0, 3.0)


# --- micro-batches and DP shards give the one-big-batch gradient ------------------------

B, T, F, V = 8, 7, 4, 5


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.tensor([1, 2, 0, 3, 1, 2, 0, 1])
    length = torch.tensor([5, 2, 1, 0, 4, 3, 7, 6])  # row 3 is padding: no loss tokens
    t = torch.arange(T)
    mask = ((t >= prompt[:, None]) & (t < prompt[:, None] + length[:, None])).float()
    return {
        "feats": torch.randn(B, T, F, generator=g),
        "tokens": torch.randint(0, V, (B, T), generator=g),
        "noise_old": 0.3 * torch.randn(B, T, generator=g),
        "noise_roll": 0.3 * torch.randn(B, T, generator=g),
        "noise_ref": 0.5 * torch.randn(B, T, generator=g),
        "adv": torch.randn(B, generator=g),
        "mask": mask,
    }


def _micro_loss(
    w: torch.Tensor,
    data: dict[str, torch.Tensor],
    rows: slice,
    name: str,
    mode: AggregationMode,
    denom: Denominator,
) -> torch.Tensor:
    part = {k: v[rows] for k, v in data.items()}
    # Ragged micro-batches: each is cut to its own length, as packing would.
    width = int(part["mask"].nonzero()[:, 1].max().item()) + 1 if part["mask"].any() else 1
    part = {k: v[:, :width] if v.dim() >= 2 else v for k, v in part.items()}
    logits = part["feats"] @ w  # (b, t, V)
    logprobs = torch.log_softmax(logits, -1).gather(-1, part["tokens"][..., None])[..., 0]
    base = logprobs.detach()
    cfg_cls = objective_config_class(name)
    extra = {"eps_low": 0.1, "eps_high": 0.1} if name == "gspo" else {}
    cfg = cfg_cls(
        aggregation=mode,
        kl_coef=0.1,
        entropy_coef=0.01,
        is_correction=ISCorrectionConfig(upper=1.5),
        **extra,
    )
    inputs = PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=base + part["noise_old"],
        advantages=part["adv"],
        loss_mask=part["mask"],
        rollout_logprobs=base + part["noise_roll"],
        ref_logprobs=base + part["noise_ref"],
        entropy=entropy_from_logits(logits),
    )
    loss, _ = build_objective(name, cfg)(inputs, denom)
    return loss


def _grad(
    w0: torch.Tensor,
    data: dict[str, torch.Tensor],
    shards: list[list[slice]],
    name: str,
    mode: AggregationMode,
) -> tuple[torch.Tensor, torch.Tensor]:
    denom = global_denominator([data["mask"][r] for shard in shards for r in shard], norm_len=T)
    grad = torch.zeros_like(w0)
    total = torch.zeros(())
    for shard in shards:  # one simulated DP rank each; grads all-reduced by sum
        w = w0.clone().requires_grad_(True)
        for rows in shard:  # gradient accumulation over micro-batches
            loss = _micro_loss(w, data, rows, name, mode, denom)
            loss.backward()
            total += loss.detach()
        assert w.grad is not None
        grad += w.grad
    return grad, total


def _split(rows: range, n: int) -> list[slice]:
    size = len(rows) // n
    return [slice(rows.start + i * size, rows.start + (i + 1) * size) for i in range(n)]


SPLITS = {
    "1x8": [_split(range(8), 1)],
    "2x4": [_split(range(8), 2)],
    "8x1": [_split(range(8), 8)],
    "dp2x2": [_split(range(0, 4), 2), _split(range(4, 8), 2)],
}


@pytest.mark.parametrize("split", ["2x4", "8x1", "dp2x2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", OBJECTIVE_NAMES)
def test_split_batches_match_one_batch(name: str, mode: AggregationMode, split: str) -> None:
    data = _batch(seed=OBJECTIVE_NAMES.index(name) * 10 + MODES.index(mode))
    w0 = torch.randn(F, V, generator=torch.Generator().manual_seed(7))
    full_grad, full_loss = _grad(w0, data, SPLITS["1x8"], name, mode)
    grad, loss = _grad(w0, data, SPLITS[split], name, mode)
    assert full_grad.abs().max() > 1e-3  # the check below is not vacuous
    torch.testing.assert_close(loss, full_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, full_grad, rtol=0, atol=1e-6)


def test_per_microbatch_mean_would_differ() -> None:
    """The property above fails for the naive average of per-micro-batch means."""
    data = _batch(seed=3)
    w0 = torch.randn(F, V, generator=torch.Generator().manual_seed(7))
    full_grad, _ = _grad(w0, data, SPLITS["1x8"], "dapo", AggregationMode.TOKEN_MEAN)
    naive = torch.zeros_like(w0)
    for rows in _split(range(8), 2):
        w = w0.clone().requires_grad_(True)
        local = global_denominator([data["mask"][rows]])
        (_micro_loss(w, data, rows, "dapo", AggregationMode.TOKEN_MEAN, local) / 2).backward()
        assert w.grad is not None
        naive += w.grad
    assert (naive - full_grad).abs().max() > 1e-4


def test_metric_shares_sum_to_global_values() -> None:
    data = _batch(seed=5)
    denom = global_denominator([data["mask"]])
    w = torch.randn(F, V, generator=torch.Generator().manual_seed(7))
    objective = build_objective("dapo")

    def metrics(rows: slice) -> dict[str, torch.Tensor]:
        part = {k: v[rows] for k, v in data.items()}
        lp = torch.log_softmax(part["feats"] @ w, -1).gather(-1, part["tokens"][..., None])[..., 0]
        inputs = PolicyLossInputs(lp, lp + part["noise_old"], part["adv"], part["mask"])
        return objective(inputs, denom)[1]

    whole = metrics(slice(0, 8))
    parts = [metrics(s) for s in _split(range(8), 4)]
    for key, value in whole.items():
        if key.endswith("_max"):
            combined = torch.stack([p[key] for p in parts]).max()
        else:
            combined = torch.stack([p[key] for p in parts]).sum()
        torch.testing.assert_close(combined, value, rtol=0, atol=1e-6, msg=key)
    assert 0 < whole["clip_frac"].item() < 1


def test_config_accepts_mode_strings() -> None:
    cfg = objective_config_class("ppo_clip")(aggregation="seq-mean-token-sum")
    assert cfg.aggregation is AggregationMode.SEQ_MEAN_TOKEN_SUM
    assert dataclasses.replace(cfg, kl_coef=0.5).aggregation is AggregationMode.SEQ_MEAN_TOKEN_SUM
    with pytest.raises(ValueError):
        objective_config_class("ppo_clip")(aggregation="mean")
