"""Context truncation keeps the task and the latest state; the training record masks
everything but the model's tokens and aligns the rollout logprobs with them."""

import pytest

from moerl.agent.trajectory import Segment, Trajectory, cut_tokens, fit_context
from moerl.rl.agent_collect import episode_samples
from moerl.rl.config import RLConfig

PROMPT = [1, 2, 3]


def _marker(k: int) -> list[int]:
    return [900, k]


def _turns(n: int, size: int = 4) -> list[Segment]:
    segs = []
    for t in range(n):
        base = 100 * (t + 1)
        segs.append(
            Segment("model", [base + i for i in range(size)], [-0.1 * (i + 1) for i in range(size)])
        )
        segs.append(Segment("observation", [base + 50 + i for i in range(size)]))
    return segs


def test_context_that_fits_is_untouched() -> None:
    segs = _turns(2)
    ids, dropped = fit_context(PROMPT, segs, 100, _marker)  # type: ignore[misc]
    assert dropped == 0 and ids == PROMPT + [i for s in segs for i in s.token_ids]


def test_overflow_drops_oldest_whole_turns_keeps_task_and_latest() -> None:
    segs = _turns(5)  # 5 turns x 8 tokens + 3 prompt = 43
    fitted = fit_context(PROMPT, segs, 3 + 2 + 16, _marker)
    assert fitted is not None
    ids, dropped = fitted
    assert dropped == 3
    latest = segs[-2].token_ids + segs[-1].token_ids
    assert ids[:3] == PROMPT and ids[3:5] == [900, 3] and ids[-8:] == latest
    assert ids[5:13] == segs[-4].token_ids + segs[-3].token_ids
    assert len(ids) <= 21


def test_no_room_for_latest_turn_ends_the_episode() -> None:
    assert fit_context(PROMPT, _turns(3), 3 + 2 + 7, _marker) is None


def test_cut_tokens_keeps_head_and_tail_with_marker() -> None:
    ids, cut = cut_tokens(list(range(20)), 8, [-1, -1])
    assert cut and ids == [0, 1, 2, -1, -1, 17, 18, 19]
    assert cut_tokens([1, 2], 8, [-1]) == ([1, 2], False)


def test_record_masks_and_logprob_alignment() -> None:
    segs = _turns(3)
    segs[4].context_truncated = True  # third model turn saw a shortened context
    traj = Trajectory(
        "t", PROMPT, segs, status="submitted", reward=1.0, step_rewards=[0.0, 0.1, 0.0]
    )
    rec = traj.to_record()
    assert rec.prompt_ids == tuple(PROMPT)
    assert len(rec.completion_ids) == len(rec.loss_mask) == len(rec.rollout_logprobs) == 24
    assert rec.loss_mask == tuple([1] * 4 + [0] * 4 + [1] * 4 + [0] * 4 + [0] * 8)
    for tok, m, lp in zip(rec.completion_ids, rec.loss_mask, rec.rollout_logprobs, strict=True):
        assert (lp != 0.0) == bool(m)
        if m:  # the logprob belongs to exactly this token
            assert lp == pytest.approx(-0.1 * (tok % 100 + 1))
    assert rec.reward == pytest.approx(1.1)
    full = traj.to_record(loss_on_truncated_context=True)
    assert full.loss_mask[16:20] == (1, 1, 1, 1)


def test_infra_failures_are_not_training_samples() -> None:
    bad = Trajectory("x", PROMPT, _turns(1), status="infra_failure", infra_error="sandbox")
    with pytest.raises(ValueError, match="infra failure"):
        bad.to_record()
    good = Trajectory("y", PROMPT, _turns(1), status="max_turns", reward=0.0)
    solved = Trajectory("z", PROMPT, _turns(1), status="submitted", reward=1.0)
    # The loop's samples of a group: the infra failure is left out, the others trained.
    samples = episode_samples([bad, good, solved], RLConfig(), loss_on_truncated_context=False,
                              group_id=0)
    assert [s.reward for s in samples] == [0.0, 1.0]
    with pytest.raises(ValueError, match="one logprob per token"):
        Segment("model", [1, 2], [0.0])


def test_packed_sequence_trains_only_on_model_tokens_with_aligned_logprobs() -> None:
    from moerl.data.rl_batch import pack, plan_microbatches

    traj = Trajectory("t", PROMPT, _turns(3), status="submitted", reward=1.0)
    sample = traj.to_record().to_rl_sample(advantage=0.5)
    (mb,) = pack([sample], plan_microbatches([sample], token_budget=64))
    on = mb.loss_mask[0].bool()
    model_ids = [i for s in traj.segments if s.role == "model" for i in s.token_ids]
    assert mb.labels[0][on].tolist() == model_ids  # loss exactly on the model's tokens
    assert mb.rollout_logprobs is not None
    lps = mb.rollout_logprobs[0][on].tolist()
    assert lps == pytest.approx([-0.1 * (i % 100 + 1) for i in model_ids])
    assert (mb.rollout_logprobs[0][~on] == 0).all()
