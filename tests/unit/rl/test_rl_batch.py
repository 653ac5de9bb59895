"""RL samples -> micro-batches: next-token alignment, loss masks, shapes, the token budget."""

from __future__ import annotations

import pytest
import torch

from moerl.data.rl_batch import RLSample, pack, plan_microbatches, rank_samples


def _sample(prompt: list[int], completion: list[int], adv: float = 1.0, **kw: object) -> RLSample:
    c = len(completion)
    return RLSample(
        prompt_ids=torch.tensor(prompt),
        completion_ids=torch.tensor(completion),
        advantage=adv,
        rollout_logprobs=-torch.arange(1, c + 1, dtype=torch.float32) / 10,
        **kw,  # type: ignore[arg-type]
    )


def test_alignment_mask_and_rollout_logprobs() -> None:
    s = _sample([5, 6, 7], [8, 9], adv=0.5)
    plan = plan_microbatches([s], token_budget=8)
    (mb,) = pack([s], plan)
    assert mb.shape == (2, 4)  # T = 5 - 1 = 4, B = 8 // 4
    assert mb.tokens[0].tolist() == [5, 6, 7, 8]
    assert mb.labels[0].tolist() == [6, 7, 8, 9]  # logprob at t is of token t + 1
    # Completion tokens 8, 9 are the labels at positions 2, 3.
    assert mb.loss_mask[0].tolist() == [0, 0, 1, 1]
    assert torch.allclose(mb.rollout_logprobs[0], torch.tensor([0, 0, -0.1, -0.2]))  # type: ignore[index]
    assert mb.advantages.tolist() == [0.5, 0.0]
    assert mb.valid[0].tolist() == [True] * 4
    # The second row is padding: no loss, not valid.
    assert mb.loss_mask[1].sum() == 0 and not mb.valid[1].any()
    assert mb.sample_index == [0]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3]


def test_environment_tokens_and_per_token_advantages() -> None:
    # Multi-turn: completion = model, tool output (no loss), model.
    s = RLSample(
        prompt_ids=torch.tensor([1, 2]),
        completion_ids=torch.tensor([3, 4, 5, 6]),
        advantage=torch.tensor([1.0, 2.0, 3.0, 4.0]),
        loss_mask=torch.tensor([1, 0, 0, 1]),
    )
    (mb,) = pack([s], plan_microbatches([s], token_budget=5))
    assert mb.shape == (1, 5)
    assert mb.loss_mask[0].tolist() == [0, 1, 0, 0, 1]
    assert mb.advantages[0].tolist() == [0, 1, 2, 3, 4]
    assert mb.rollout_logprobs is None


def test_token_budget_shapes_and_dp_split() -> None:
    samples = [_sample([1] * (i % 3 + 1), [2] * (i % 4 + 1)) for i in range(7)]
    longest = max(len(s) for s in samples) - 1  # 6
    plan = plan_microbatches(samples, token_budget=16, dp_size=2, pad_multiple=4)
    assert plan.seq_length == 8 and plan.seq_length >= longest
    assert plan.rows == 2 and plan.per_rank == 4 and plan.num_microbatches == 2
    seen: list[int] = []
    for rank in range(2):
        micro = pack(samples, plan, dp_rank=rank)
        assert len(micro) == plan.num_microbatches  # same count on every rank
        for mb in micro:
            assert mb.shape == (2, 8)
            assert mb.tokens.numel() <= 16
            seen += mb.sample_index
        packed = [i for mb in micro for i in mb.sample_index]
        assert list(rank_samples(samples, plan, rank)) == packed
    assert seen == list(range(7))
    total_mask = sum(float(mb.loss_mask.sum()) for r in range(2) for mb in pack(samples, plan, r))
    assert total_mask == sum(s.completion_ids.numel() for s in samples)


def test_budget_too_small_and_bad_shapes() -> None:
    with pytest.raises(ValueError, match="token_budget"):
        plan_microbatches([_sample([1, 2, 3], [4, 5, 6])], token_budget=4)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        RLSample(torch.tensor([1]), torch.tensor([2, 3]), 1.0, rollout_logprobs=torch.zeros(3))
    with pytest.raises(ValueError, match="routed_experts"):
        RLSample(torch.tensor([1]), torch.tensor([2]), 1.0, routed_experts=torch.zeros(2, 3, 2))


def test_routed_experts_follow_the_input_tokens() -> None:
    routed = torch.arange(2 * 4 * 2).reshape(2, 4, 2)  # (layers, P + C, topk)
    s = RLSample(torch.tensor([1, 2]), torch.tensor([3, 4]), 1.0, routed_experts=routed)
    (mb,) = pack([s], plan_microbatches([s], token_budget=6))
    assert mb.routed_experts is not None and mb.routed_experts.shape == (2, 2, 3, 2)
    assert torch.equal(mb.routed_experts[:, 0], routed[:, :3])  # input tokens only
    assert mb.routed_experts[:, 1].tolist() == [[[0, 1]] * 3] * 2  # padding: distinct ids
