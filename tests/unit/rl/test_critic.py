"""The critic on the tiny Megatron MoE, one process: its start from the policy, its values,
its gradient, its learning, the warm-up in the loop's update, and its checkpoint entry
(an exact resume)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.moe import moe_logging

from moerl.checkpoint.config import CheckpointConfig, CheckpointError, Fingerprints
from moerl.data.rl_batch import RLSample
from moerl.models.arch import TINY
from moerl.parallel.groups import ParallelGroups, destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.rl.config import RLConfig
from moerl.rl.critic import Critic
from moerl.rl.critic_config import CriticConfig
from moerl.rl.loop import StepEnd, update
from moerl.rl.losses import global_denominator
from moerl.rl.losses.value import clipped_value_loss
from moerl.rl.peers import Peers
from moerl.rl.resume import RLCheckpoints
from moerl.signals import StopOnSignal
from moerl.trainer.config import OptimConfig

OPTIM = OptimConfig(lr=3e-3, min_lr=0.0, clip_grad=0.0)


@pytest.fixture(scope="module")
def groups() -> Iterator[ParallelGroups]:
    g = init_parallel(ParallelLayout(), seed=3)
    yield g
    destroy_parallel()


def samples(n: int = 6, seed: int = 0) -> list[RLSample]:
    gen = torch.Generator().manual_seed(seed)
    return [RLSample(torch.randint(TINY.vocab_size, (3 + i % 2,), generator=gen),
                     torch.randint(TINY.vocab_size, (4 + i % 3,), generator=gen), advantage=0.0,
                     reward=float(i % 2), rollout_logprobs=-torch.rand(4 + i % 3, generator=gen),
                     group_id=i // 2)
            for i in range(n)]


def build(groups: ParallelGroups, critic: CriticConfig | None = None, seed: int = 11,
          kl_in_reward: float = 0.0) -> Peers:
    """The policy, its reference and the critic (its head drawn from `seed`)."""
    moe_logging.destroy_moe_metrics_tracker()
    torch.manual_seed(seed)
    return Peers.build(TINY, groups.layout, OPTIM, groups,
                       RLConfig(objective="ppo_clip", token_budget=32, advantage="gae",
                                kl_in_reward=kl_in_reward, critic=critic or CriticConfig(),
                                seed=seed))


def train(peers: Peers, batch: list[RLSample], num_minibatches: int = 1) -> dict[str, float]:
    """The loop's update of the critic and the policy on `batch`."""
    return update(peers.policy.cfg, peers, batch, num_minibatches)


def _module(chunks: list[torch.nn.Module]) -> torch.nn.Module:
    return chunks[0].module  # type: ignore[no-any-return]


def _critic(peers: Peers) -> Critic:
    assert peers.critic is not None
    return peers.critic


def test_the_critic_starts_from_the_policy_with_a_zero_head(groups: ParallelGroups) -> None:
    peers = build(groups)
    mine = _module(_critic(peers).chunks).state_dict()
    theirs = _module(peers.policy.chunks).state_dict()
    head = {k for k in mine if k.startswith("value_head.")}
    assert head == {"value_head.weight", "value_head.bias"}
    for key in set(mine) - head:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)
    # No vocabulary projection and no MTP head in the critic.
    assert not any(k.startswith(("output_layer.", "mtp.")) for k in mine)
    assert any(k.startswith("output_layer.") for k in theirs)
    micro = peers.policy.pack(samples())
    assert len(micro) > 1
    for mb, v in zip(micro, _critic(peers).values(micro), strict=True):
        assert v.shape == mb.shape and not v.any()  # V = 0 everywhere at the start


def test_values_are_the_models_forward(groups: ParallelGroups) -> None:
    peers = build(groups, CriticConfig(head_init_std=0.05))
    critic = _critic(peers)
    model = _module(critic.chunks)
    micro = peers.policy.pack(samples())
    model.eval()
    for mb, v in zip(micro, critic.values(micro), strict=True):
        with torch.no_grad():
            want = model(mb.tokens, mb.position_ids, None)  # (B, T)
        torch.testing.assert_close(v, want, rtol=0, atol=1e-6)
        assert float(v.abs().max()) > 1e-3
    # The head is drawn from the seed, the same on every rank and build.
    again = build(groups, CriticConfig(head_init_std=0.05))
    torch.testing.assert_close(_module(_critic(again).chunks).value_head.weight,
                               model.value_head.weight, rtol=0, atol=0)


def test_gradient_equals_direct_autograd(groups: ParallelGroups) -> None:
    peers = build(groups, CriticConfig(head_init_std=0.05, value_clip=0.02))
    critic = _critic(peers)
    micro = peers.policy.pack(samples(seed=2))
    values = critic.values(micro)
    gen = torch.Generator().manual_seed(4)
    old = [v + 0.05 * torch.randn(v.shape, generator=gen) for v in values]  # some clip
    returns = [torch.randn(v.shape, generator=gen) for v in values]
    denom = global_denominator([mb.loss_mask for mb in micro])
    model = _module(critic.chunks)
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    reports = critic.forward_backward(micro, old, returns, denom)
    assert 0 < sum(float(r["value_clip_frac"]) for r in reports) < 1  # both branches
    params = [p for p in model.parameters() if p.requires_grad]
    got = [p.main_grad.clone() for p in params]  # type: ignore[attr-defined]
    for name, buf in model.named_buffers():  # finalize_model_grads moved the expert bias
        if name in biases:
            buf.copy_(biases[name])
    total = sum(clipped_value_loss(model(mb.tokens, mb.position_ids, None), old[k], returns[k],
                                   mb.loss_mask, 0.02, denom)[0] for k, mb in enumerate(micro))
    assert isinstance(total, torch.Tensor)
    want = torch.autograd.grad(total, params, allow_unused=True)
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        w = torch.zeros_like(g) if w is None else w
        worst = max(worst, float((g - w).abs().max() / (w.abs().max() + 1e-12)))
    assert worst < 1e-4, worst
    assert sum(float(r["value_loss"]) for r in reports) == pytest.approx(float(total), abs=1e-6)


def test_the_critic_learns_its_targets(groups: ParallelGroups) -> None:
    peers = build(groups, CriticConfig(lr=5e-4))
    critic = _critic(peers)
    micro = peers.policy.pack(samples(seed=3))
    returns = [mb.loss_mask * torch.linspace(-1, 1, mb.shape[1]) for mb in micro]
    denom = global_denominator([mb.loss_mask for mb in micro])
    losses = [critic.update(micro, critic.values(micro), returns, denom)["value_loss"]
              for _ in range(4)]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.7 * losses[0], losses


def test_warm_up_trains_the_critic_alone(groups: ParallelGroups) -> None:
    peers = build(groups, CriticConfig(warmup_steps=1), kl_in_reward=0.1)
    batch = samples(seed=5)

    def weights(chunks: list[torch.nn.Module]) -> list[torch.Tensor]:
        return [p.detach().clone() for p in _module(chunks).parameters()]

    pol, cri = weights(peers.policy.chunks), weights(_critic(peers).chunks)
    first = train(peers, batch, 2)
    assert first["critic_warmup"] == 1.0 and "loss" not in first and "grad_norm" not in first
    assert all(torch.equal(a, b) for a, b in zip(pol, weights(peers.policy.chunks), strict=True))
    assert not all(torch.equal(a, b)
                   for a, b in zip(cri, weights(_critic(peers).chunks), strict=True))
    second = train(peers, batch, 2)
    assert second["critic_warmup"] == 0.0 and second["optimizer_steps"] == 2.0
    assert not all(torch.equal(a, b)
                   for a, b in zip(pol, weights(peers.policy.chunks), strict=True))
    for m in (first, second):
        for key in ("value_loss", "explained_variance", "advantages_mean", "advantages_std",
                    "returns_mean", "values_mean", "critic_grad_norm", "kl_in_reward"):
            assert key in m and m[key] == m[key], key  # present and not nan
    assert first["values_mean"] == 0.0 and first["explained_variance"] == pytest.approx(0.0)
    assert second["values_mean"] != 0.0  # the critic moved in the first step


def test_a_smaller_critic_of_its_own(groups: ParallelGroups) -> None:
    small = CriticConfig(model={"num_layers": 2}, init_from_policy=False, head_init_std=0.05)
    peers = build(groups, small)
    critic = _critic(peers)
    assert critic.arch.num_layers == 2
    assert len(_module(critic.chunks).decoder.layers) == 2
    metrics = train(peers, samples(seed=6))
    assert metrics["value_loss"] > 0 and metrics["critic_grad_norm"] > 0
    assert "loss" in metrics  # the policy (4 layers) trained beside it


def _hook(ckpt: RLCheckpoints, peers: Peers, step: int) -> None:
    with StopOnSignal(()) as stop:
        ckpt.step_end_hook(peers, stop, steps=10)(StepEnd(step, {"position": step}))


def test_a_resume_continues_the_critic_exactly(groups: ParallelGroups, tmp_path: Path) -> None:
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"), save_interval=1)
    marks = Fingerprints.of(TINY, "data", "run")
    batch, later = samples(seed=7), samples(seed=8)
    critic_cfg = CriticConfig(warmup_steps=2, head_init_std=0.05)

    ckpt = RLCheckpoints(cfg, marks, None, seed=11, layout=groups.layout.describe())
    first = build(groups, critic_cfg)
    assert ckpt.load(first) is None  # a fresh start
    train(first, batch, 2)
    _hook(ckpt, first, 0)  # saves step 1 with the critic
    ckpt.close()
    want = train(first, later, 2)  # still warming up: the critic alone moves
    want_values = _critic(first).values(first.policy.pack(later))

    resumed = RLCheckpoints(cfg, marks, None, seed=11, layout=groups.layout.describe())
    second = build(groups, critic_cfg, seed=99)  # other weights until the load
    state = resumed.load(second)
    assert state is not None and state.next_step == 1 and second.updates == 1
    got = train(second, later, 2)
    for key in ("value_loss", "critic_grad_norm", "explained_variance", "advantages_std",
                "critic_warmup"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    for a, b in zip(want_values, _critic(second).values(second.policy.pack(later)), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    resumed.close()

    # A checkpoint saved without a critic cannot resume a run that has one.
    plain = dataclasses.replace(cfg, dir=str(tmp_path / "plain"))
    without = RLCheckpoints(plain, marks, None, seed=11, layout=groups.layout.describe())
    no_critic = build(groups, critic_cfg)
    critic, no_critic.critic = no_critic.critic, None
    without.load(no_critic)
    _hook(without, no_critic, 0)
    without.close()
    no_critic.critic = critic
    with pytest.raises(CheckpointError, match=r"holds no critic"):
        RLCheckpoints(plain, marks, None, seed=11, layout=groups.layout.describe()).load(no_critic)
