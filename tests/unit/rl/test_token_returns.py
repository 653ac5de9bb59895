"""REINFORCE++ advantages computed in the update (`rl.token_returns`): the same numbers
as the reference formula (`advantages.reinforce_plus_plus`) on the packed micro-batches,
the KL penalty included, whitened over the whole step rather than per micro-batch; and
the config choices around them."""

from __future__ import annotations

import pytest
import torch

from moerl.data.rl_batch import RLSample, pack, plan_microbatches
from moerl.rl.advantages import reinforce_plus_plus
from moerl.rl.config import RLConfig
from moerl.rl.token_returns import reinforce_pp


def _samples(n: int, seed: int = 0) -> list[RLSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + i % 4
        reward = float(i % 3 == 0)
        out.append(RLSample(torch.tensor([1, 2, 3]), torch.randint(5, 50, (length,), generator=gen),
                            advantage=reward, reward=reward,
                            rollout_logprobs=-torch.rand(length, generator=gen), group_id=i // 2))
    return out


def _logprobs(like: torch.Tensor, seed: int) -> torch.Tensor:
    return -torch.rand(like.shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_one_micro_batch_equals_the_formula(kl_coef: float) -> None:
    samples = _samples(6)
    (mb,) = pack(samples, plan_microbatches(samples, token_budget=4096))
    old, ref = _logprobs(mb.loss_mask, 1), _logprobs(mb.loss_mask, 2)
    (out,), metrics = reinforce_pp([mb], [old], [ref], kl_coef, 1.0, None)
    rows = mb.loss_mask.bool().any(dim=-1)  # the rest of the rows are padding
    assert int(rows.sum()) == len(samples) < rows.numel()
    want = reinforce_plus_plus(mb.advantages[rows], mb.loss_mask[rows],
                               kl=(old - ref)[rows], kl_coef=kl_coef)
    torch.testing.assert_close(out.advantages[rows], want)
    assert not out.advantages[~rows].any()
    penalty = kl_coef * ((old - ref) * mb.loss_mask).sum() / mb.loss_mask.sum()
    assert metrics["kl_in_reward"] == pytest.approx(float(penalty), abs=1e-6)


def test_the_engines_logprobs_stand_in_for_the_sampling_policy() -> None:
    samples = _samples(4)
    (mb,) = pack(samples, plan_microbatches(samples, token_budget=4096))
    ref = _logprobs(mb.loss_mask, 2)
    assert mb.rollout_logprobs is not None
    (out,), _ = reinforce_pp([mb], [None], [ref], 0.3, 1.0, None)
    rows = mb.loss_mask.bool().any(dim=-1)
    want = reinforce_plus_plus(mb.advantages[rows], mb.loss_mask[rows],
                               kl=(mb.rollout_logprobs - ref)[rows], kl_coef=0.3)
    torch.testing.assert_close(out.advantages[rows], want)


def test_whitening_spans_every_micro_batch_of_the_step() -> None:
    samples = _samples(12)
    micro = pack(samples, plan_microbatches(samples, token_budget=32))
    assert len(micro) > 1
    out, _ = reinforce_pp(micro, [None] * len(micro), [None] * len(micro), 0.0, 1.0, None)
    values = torch.cat([mb.advantages[mb.loss_mask.bool()] for mb in out])
    assert abs(float(values.mean())) < 1e-5 and float(values.std()) == pytest.approx(1.0, 1e-4)
    # each sample's tokens all carry its whitened reward (no KL, gamma 1)
    for mb in out:
        for row in range(mb.loss_mask.shape[0]):
            picked = mb.advantages[row][mb.loss_mask[row].bool()]
            if picked.numel():
                assert torch.allclose(picked, picked[0].expand_as(picked))


def test_kl_in_the_reward_needs_reinforce_pp_and_a_sign() -> None:
    assert RLConfig(advantage="reinforce_pp", kl_in_reward=0.01).kl_in_reward == 0.01
    with pytest.raises(ValueError, match=r"rl\.kl_in_reward=0\.01 with rl\.advantage=grpo.*"
                                         r"rl\.advantage=reinforce_pp"):
        RLConfig(kl_in_reward=0.01)
    with pytest.raises(ValueError, match=r"rl\.kl_in_reward: must be >= 0"):
        RLConfig(advantage="reinforce_pp", kl_in_reward=-1.0)
