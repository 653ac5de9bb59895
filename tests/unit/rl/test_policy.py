"""The policy on the tiny Megatron MoE, one process: logprobs, gradient, learning, replay
(beside its reference model, as the loop drives both)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron.core.transformer.moe import moe_logging
from policy_logprobs import completion_logprobs

from moerl.data.rl_batch import RLSample
from moerl.models.arch import TINY, MoEArch
from moerl.models.weights import load_weights
from moerl.models.weights_marker import is_complete
from moerl.parallel.groups import ParallelGroups, destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.rl.config import RLConfig
from moerl.rl.loop import update
from moerl.rl.losses import GRPOConfig, PolicyLossInputs
from moerl.rl.losses.entropy import entropy_from_logits
from moerl.rl.peers import Peers
from moerl.rl.policy import Policy, _aux_losses
from moerl.rl.reference import Reference
from moerl.rl.routing import RoutingReplay
from moerl.trainer.config import OptimConfig


@pytest.fixture(scope="module")
def groups() -> Iterator[ParallelGroups]:
    g = init_parallel(ParallelLayout(), seed=3)
    yield g
    destroy_parallel()


def make_samples(n: int, vocab: int, seed: int = 0, advantages: list[float] | None = None
                 ) -> list[RLSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = 3 + i % 3, 4 + i % 4
        adv = advantages[i] if advantages else float(torch.randn((), generator=gen))
        out.append(RLSample(
            prompt_ids=torch.randint(vocab, (p,), generator=gen),
            completion_ids=torch.randint(vocab, (c,), generator=gen),
            advantage=adv,
            rollout_logprobs=-torch.rand(c, generator=gen) * 6,
            group_id=i // 2,
        ))
    return out


def build(groups: ParallelGroups, arch: MoEArch = TINY, lr: float = 1e-3,
          obj_cfg: GRPOConfig | None = None, **rl: Any) -> Peers:
    """A GRPO policy (`obj_cfg`: its config) and its reference; `rl`: fields of the rl
    group to set."""
    moe_logging.destroy_moe_metrics_tracker()
    torch.manual_seed(11)
    cfg = RLConfig(**{"token_budget": 32, "routing_replay": True, **rl,
                      **({"objective_args": obj_cfg} if obj_cfg else {})})
    return Peers.build(arch, groups.layout, OptimConfig(lr=lr, min_lr=0.0, clip_grad=0.0),
                       groups, cfg)


def train(peers: Peers, samples: list[RLSample], num_minibatches: int = 1) -> dict[str, float]:
    """The loop's update of the policy on `samples`."""
    return update(peers.policy.cfg, peers, samples, num_minibatches)


def _unwrapped(policy: Policy) -> torch.nn.Module:
    return policy.trainable.model[0].module


def test_logprobs_match_full_forward(groups: ParallelGroups) -> None:
    policy = build(groups).policy
    samples = make_samples(5, TINY.vocab_size)
    micro = policy.pack(samples)
    assert len(micro) > 1  # several micro-batches in one schedule call
    model = _unwrapped(policy)
    model.eval()
    for mb, (lp, ent) in zip(micro, policy.logprobs(micro), strict=True):
        with torch.no_grad():
            logits = model(mb.tokens, mb.position_ids, None)  # (B, T, V), one rank: full V
        want = torch.log_softmax(logits.float(), -1).gather(-1, mb.labels[..., None])[..., 0]
        assert (lp - want).abs().max() < 1e-5
        assert (ent - entropy_from_logits(logits)).abs().max() < 1e-5
    per_sample = completion_logprobs(policy, samples)
    assert [t.numel() for t in per_sample] == [s.completion_ids.numel() for s in samples]


def test_gradient_equals_direct_autograd(groups: ParallelGroups) -> None:
    # The update's gradient is the objective's alone (aux_losses=False), MTP head included.
    arch = TINY
    obj_cfg = GRPOConfig(kl_coef=0.1, entropy_coef=0.01, eps_low=0.2, eps_high=0.2)
    peers = build(groups, arch, obj_cfg=obj_cfg, token_budget=24, recompute_old_logprobs=False)
    policy = peers.policy
    samples = make_samples(6, arch.vocab_size, seed=1)
    # Old logprobs = current ones + noise, so some ratios leave the clip range.
    current = completion_logprobs(policy, samples)
    gen = torch.Generator().manual_seed(5)
    samples = [dataclasses.replace(
        s, rollout_logprobs=lp + 0.4 * torch.randn(lp.shape, generator=gen))
        for s, lp in zip(samples, current, strict=True)]
    prepared = peers.prepare(samples)
    assert len(prepared.micro) >= 2
    model = _unwrapped(policy)
    # finalize_model_grads moves the routers' expert bias; route the direct pass as before.
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    reports = policy.forward_backward(prepared)
    assert sum(float(r["clip_frac"]) for r in reports) > 0  # the clip branch is exercised
    params = [p for p in _unwrapped(policy).parameters() if p.requires_grad]
    got = [p.main_grad.clone() for p in params]  # type: ignore[attr-defined]
    for name, buf in model.named_buffers():
        if name in biases:
            buf.copy_(biases[name])

    total = torch.zeros(())
    for k, mb in enumerate(prepared.micro):
        with _aux_losses(model.config, keep=False):
            logits = model(mb.tokens, mb.position_ids, None).float()  # (B, T, V)
        log_p = torch.log_softmax(logits, -1)
        lp = log_p.gather(-1, mb.labels[..., None])[..., 0]
        loss, _ = policy.objective(PolicyLossInputs(
            logprobs=lp, old_logprobs=prepared.old[k], advantages=mb.advantages,
            loss_mask=mb.loss_mask, rollout_logprobs=mb.rollout_logprobs,
            ref_logprobs=prepared.ref[k] if prepared.ref else None,
            entropy=entropy_from_logits(logits)), prepared.denom)
        total = total + loss
    want = torch.autograd.grad(total, params, allow_unused=True)
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        w = torch.zeros_like(g) if w is None else w
        worst = max(worst, float((g - w).abs().max() / (w.abs().max() + 1e-12)))
    assert worst < 1e-4, worst
    assert sum(float(r["loss"]) for r in reports) == pytest.approx(float(total), abs=1e-6)


def test_update_learns_from_rewards(groups: ParallelGroups, tmp_path: Path) -> None:
    peers = build(groups, lr=3e-3, obj_cfg=GRPOConfig(kl_coef=0.0))
    policy = peers.policy
    prompt = torch.tensor([7, 8, 9])
    gen = torch.Generator().manual_seed(2)
    samples = [RLSample(prompt, torch.randint(TINY.vocab_size, (6,), generator=gen),
                        advantage=a, reward=float(a > 0), group_id=0)
               for a in (1.0, 1.0, -1.0, -1.0)]

    def total_logprob() -> list[float]:
        return [float(t.sum()) for t in completion_logprobs(policy, samples)]

    before = total_logprob()
    history = [train(peers, samples) for _ in range(3)]
    after = total_logprob()
    assert after[0] > before[0] and after[1] > before[1]
    assert after[2] < before[2] and after[3] < before[3]
    kls = [m["kl_ref"] for m in history]
    assert abs(kls[0]) < 1e-6 < kls[1] < kls[2]
    for m in history:
        assert {"loss", "clip_frac", "entropy", "grad_norm", "tokens"} <= set(m)
        assert m["tokens"] == 24
        assert any(k.startswith("moe/layer") for k in m)
    # Expert load: every real input token routed to topk experts in each MoE layer.
    counts = policy.load.totals()
    real_tokens = sum(len(s) - 1 for s in samples)
    for layer in range(TINY.first_k_dense, TINY.num_layers):
        assert counts[layer].sum() == real_tokens * TINY.moe_router_topk

    path = policy.publish(tmp_path / "v1")
    assert is_complete(path)
    assert peers.reference is not None
    load_weights(peers.reference.chunks, path)
    ref = [float(t.sum()) for t in _ref_logprobs(peers, samples)]
    assert ref == pytest.approx(after, abs=1e-5)


def _ref_logprobs(peers: Peers, samples: list[RLSample]) -> list[torch.Tensor]:
    assert peers.reference is not None
    micro = peers.policy.pack(samples)
    out = []
    for mb, (lp, _) in zip(micro, peers.reference.logprobs(micro), strict=True):
        for row, i in enumerate(mb.sample_index):
            p, c = samples[i].prompt_ids.numel(), samples[i].completion_ids.numel()
            out.append(lp[row, p - 1 : p - 1 + c])
    return out


def test_routing_replay(groups: ParallelGroups) -> None:
    policy = build(groups).policy
    samples = make_samples(3, TINY.vocab_size, seed=4)
    micro = policy.pack(samples)
    assert len(micro) == 1
    replay = RoutingReplay(policy.chunks, TINY)
    replay.record()
    (free, _), = policy.logprobs(micro)
    recorded = replay.recorded()  # layer -> (T * B, k), s-major
    replay.disarm()
    b, t = micro[0].shape
    per_layer = [recorded[n].reshape(t, b, -1).transpose(0, 1) for n in sorted(recorded)]

    def with_routing(shift: int) -> list[RLSample]:
        out = []
        for row, i in enumerate(micro[0].sample_index):
            n = len(samples[i]) - 1
            routed = torch.stack([(r[row, :n] + shift) % TINY.num_experts for r in per_layer])
            routed = torch.cat([routed, routed[:, -1:]], dim=1)  # (layers, P + C, k)
            out.append(dataclasses.replace(samples[i], routed_experts=routed))
        return out

    (same, _), = policy.logprobs(policy.pack(with_routing(0)))
    (other, _), = policy.logprobs(policy.pack(with_routing(1)))
    real = micro[0].valid
    assert (same - free)[real].abs().max() < 1e-6
    assert (other - free)[real].abs().max() > 1e-3


def test_first_minibatch_takes_pi_old_from_its_own_forward(groups: ParallelGroups) -> None:
    """Before the first optimizer step the weights are pi_old's, so the update's own
    forward (detached) replaces the recompute pass: same step, one forward fewer."""
    samples = make_samples(6, TINY.vocab_size, seed=4)
    reused, recomputed = build(groups), build(groups)
    passes: list[bool] = []
    reference = reused.reference
    assert reference is not None

    def counting(micro: Any) -> Any:
        passes.append(False)
        return Policy.logprobs(reused.policy, micro)

    def counting_reference(micro: Any) -> Any:
        passes.append(True)
        return Reference.logprobs(reference, micro)

    reused.policy.logprobs = counting  # type: ignore[method-assign]
    reference.logprobs = counting_reference  # type: ignore[method-assign]
    a = train(reused, samples)
    assert passes == [True]  # the reference only
    b = recomputed.policy._step(recomputed.prepare(samples, first=False))
    for key in ("loss", "grad_norm", "kl_ref"):
        if key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    for p, q in zip(reused.policy.chunks[0].parameters(),
                    recomputed.policy.chunks[0].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)



def test_update_without_mtp_loss_skips_the_mtp_layers(groups: ParallelGroups,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """rl.aux_losses=false scales the MTP loss by 0, so the update leaves the MTP layers
    out: they do not run, and the weights after two optimizer steps are those of an
    update that runs them."""
    import moerl.rl.policy as policy_module

    arch = dataclasses.replace(TINY, mtp_num_layers=1)
    samples = make_samples(6, arch.vocab_size, seed=2)
    skipped, run = build(groups, arch), build(groups, arch)
    real, forced = policy_module.run_schedule, {"mtp": False}

    def schedule(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **{**kwargs, "mtp": kwargs["mtp"] or forced["mtp"]})

    monkeypatch.setattr(policy_module, "run_schedule", schedule)
    calls = {"skipped": 0, "run": 0}
    for name, peers in (("skipped", skipped), ("run", run)):
        forced["mtp"] = name == "run"

        def count(*_: Any, name: str = name) -> None:
            calls[name] += 1

        handle = _unwrapped(peers.policy).mtp.register_forward_hook(count)
        train(peers, samples, num_minibatches=2)
        handle.remove()
    assert calls["skipped"] == 0 and calls["run"] >= 2  # at least one per minibatch
    for p, q in zip(skipped.policy.chunks[0].parameters(), run.policy.chunks[0].parameters(),
                    strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
