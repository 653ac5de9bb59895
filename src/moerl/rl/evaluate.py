"""Held-out evaluation through the same rollout and reward servers as training."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from moerl.data.prompts import PromptRecord
from moerl.rewards.client import RewardClient
from moerl.rl.config import SamplingConfig
from moerl.rl.scoring import score_groups
from moerl.rollout.client import RolloutClient


def evaluate(
    engines: RolloutClient,
    judges: RewardClient,
    records: Sequence[PromptRecord],
    sampling: SamplingConfig,
    encode: Callable[[PromptRecord], list[int]],
    step: int,
    stop_token_ids: tuple[int, ...] = (),
) -> dict[str, float]:
    """Pass rate (all tests pass) and mean reward, one sample per held-out prompt."""
    if not records:
        return {}
    prompts = [encode(r) for r in records]
    groups = engines.generate(prompts, n=1, sampling=sampling.params(
        n=1, seed=step, stop_token_ids=stop_token_ids))
    scored, _ = score_groups(judges, records, groups, step=-1 - step)
    rewards = [res.reward for g in scored for res in g.results if res.reward is not None]
    return {
        "eval/pass_rate": statistics.fmean(r == 1.0 for r in rewards) if rewards else 0.0,
        "eval/mean_reward": statistics.fmean(rewards) if rewards else 0.0,
        "eval/infra_errors": float(sum(
            res.error_kind is not None for g in scored for res in g.results)),
    }
