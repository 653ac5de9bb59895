"""Engine vs trainer logprobs: the `logprob_gap/*` metrics of the policy update."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch
from megatron.core.transformer.moe import moe_logging
from policy_logprobs import completion_logprobs

from moerl.data.rl_batch import RLSample
from moerl.models.arch import TINY
from moerl.parallel.groups import ParallelGroups, destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.rl.config import RLConfig
from moerl.rl.loop import update
from moerl.rl.losses import GRPOConfig
from moerl.rl.peers import Peers
from moerl.rl.policy import Policy
from moerl.trainer.config import OptimConfig


@pytest.fixture(scope="module")
def policy() -> Iterator[Policy]:
    groups: ParallelGroups = init_parallel(ParallelLayout(), seed=3)
    moe_logging.destroy_moe_metrics_tracker()
    torch.manual_seed(11)
    yield Policy.build(TINY, groups.layout, OptimConfig(lr=1e-3, min_lr=0.0, clip_grad=0.0),
                       groups, RLConfig(objective_args=GRPOConfig(kl_coef=0.0), token_budget=32,
                                        use_reference=False))
    destroy_parallel()


def _update(policy: Policy, samples: list[RLSample], minibatches: int = 1) -> dict[str, float]:
    """The loop's update of the policy alone (no reference, no critic)."""
    return update(policy.cfg, Peers(policy), samples, minibatches)


def _samples(policy: Policy, shift: float) -> list[RLSample]:
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(5):  # several micro-batches at token_budget=32
        p, c = 3 + i % 3, 4 + i % 4
        samples.append(RLSample(prompt_ids=torch.randint(TINY.vocab_size, (p,), generator=gen),
                                completion_ids=torch.randint(TINY.vocab_size, (c,), generator=gen),
                                advantage=float(i % 2) - 0.5))
    # The last completion token of sample 0 is masked out: its huge gap must not count.
    samples[0] = dataclasses.replace(samples[0], loss_mask=torch.tensor([1.0, 1.0, 1.0, 0.0]))
    trainer = completion_logprobs(policy, samples)
    out = []
    for s, lp in zip(samples, trainer, strict=True):
        engine = lp + shift
        if s.loss_mask is not None:
            engine[-1] -= 5.0
        out.append(dataclasses.replace(s, rollout_logprobs=engine))
    return out


def test_identical_logprobs_give_no_gap(policy: Policy) -> None:
    samples = _samples(policy, 0.0)
    assert len(policy.pack(samples)) > 1
    for minibatches in (1, 2):  # the second minibatch's pi_old is computed before any step
        gap = _update(policy, _samples(policy, 0.0), minibatches)
        assert gap["logprob_gap/mean_abs"] < 1e-5
        assert gap["logprob_gap/max_abs"] < 1e-5
        assert abs(gap["logprob_gap/prob_diff"]) < 1e-5


def test_shifted_logprobs_give_that_gap(policy: Policy) -> None:
    samples = _samples(policy, 0.1)
    # exp(lp + 0.1) - exp(lp) = (e^0.1 - 1) p, averaged over the counted tokens.
    trainer = completion_logprobs(policy, samples)
    probs = torch.cat([(lp[:-1] if s.loss_mask is not None else lp).exp()
                       for s, lp in zip(samples, trainer, strict=True)])
    want = (math.exp(0.1) - 1) * float(probs.double().mean())
    gap = _update(policy, samples)  # the loop logs these as train/logprob_gap/...
    assert gap["logprob_gap/mean_abs"] == pytest.approx(0.1, abs=1e-5)
    assert gap["logprob_gap/max_abs"] == pytest.approx(0.1, abs=1e-5)
    assert gap["logprob_gap/prob_diff"] == pytest.approx(want, rel=1e-4)
    assert not any(k.endswith(("_sum", "/tokens", "abs_max")) for k in gap if "gap" in k)


def test_no_rollout_logprobs_no_gap(policy: Policy) -> None:
    samples = [dataclasses.replace(s, rollout_logprobs=None) for s in _samples(policy, 0.0)]
    assert not any(k.startswith("logprob_gap/") for k in _update(policy, samples))
