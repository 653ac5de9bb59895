"""From generated groups to training samples: rewards, filtering, advantages.

Infra errors (sandbox or reward-server failures) are kept apart from model
failures all the way: such a sample gets no reward, is never trained on, and is
counted in `reward/infra_errors`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moerl.agent.trajectory import Trajectory
from moerl.data.prompts import PromptRecord
from moerl.data.rl_batch import RLSample
from moerl.rewards.client import RewardClient, ScoreItem
from moerl.rewards.protocol import RewardResult
from moerl.rl.advantages import group_normalized, rloo
from moerl.rl.config import RLConfig
from moerl.rl.group import Outcome, has_spread
from moerl.rollout.types import Sample


@dataclass
class ScoredGroup:
    """A single-shot prompt's samples and the reward servers' results (a `Group`)."""

    record: PromptRecord
    samples: list[Sample]
    results: list[RewardResult]

    def rewards(self, cfg: RLConfig | None = None) -> list[float | None]:
        out: list[float | None] = []
        for sample, result in zip(self.samples, self.results, strict=True):
            if result.reward is None:
                out.append(None)
            else:
                out.append(result.reward - (overlong_penalty(sample, cfg) if cfg else 0.0))
        return out

    @property
    def trajectories(self) -> Sequence[Trajectory]:
        return ()

    @property
    def informative(self) -> bool:
        return has_spread(self.rewards())

    def outcomes(self) -> list[Outcome]:
        return [Outcome(result.reward, len(sample.token_ids), sample.finish_reason == "length",
                        sample.finish_reason == "stop", result.seconds, result.compile_ok)
                for sample, result in zip(self.samples, self.results, strict=True)]

    def to_samples(self, cfg: RLConfig, group_id: int) -> list[RLSample]:
        """Samples with advantages; infra-error samples are left out of their group."""
        pairs = [(s, r) for s, r in zip(self.samples, self.rewards(cfg), strict=True)
                 if r is not None]
        if len(pairs) < 2:
            return []
        adv = advantages(torch.tensor([[r for _, r in pairs]], dtype=torch.float32),
                         cfg.advantage)
        return [RLSample(
            prompt_ids=torch.tensor(sample.prompt_token_ids, dtype=torch.int64),
            completion_ids=torch.tensor(sample.token_ids, dtype=torch.int64),
            advantage=float(a),
            rollout_logprobs=torch.tensor(sample.logprobs, dtype=torch.float32),
            reward=reward,
            weight_version=sample.weight_version,
            group_id=group_id,
            routed_experts=routed_tensor(sample),
            token_versions=None if sample.token_versions is None
            else torch.tensor(sample.token_versions, dtype=torch.int64),
        ) for (sample, reward), a in zip(pairs, adv[0].tolist(), strict=True)]


def overlong_penalty(sample: Sample, cfg: RLConfig) -> float:
    """DAPO's soft penalty: 0 until max_tokens - buffer, then linear up to the penalty."""
    if not cfg.overlong_buffer:
        return 0.0
    start = cfg.sampling.max_tokens - cfg.overlong_buffer
    over = len(sample.token_ids) - start
    return cfg.overlong_penalty * min(max(over, 0) / cfg.overlong_buffer, 1.0)


def score_groups(
    reward_client: RewardClient, records: Sequence[PromptRecord], groups: Sequence[list[Sample]],
    step: int,
) -> tuple[list[ScoredGroup], dict[str, float]]:
    """Score every sample of every group in one batched call to the reward servers."""
    items = [
        ScoreItem(record.reward, sample.text, record.spec)
        for record, group in zip(records, groups, strict=True)
        for sample in group
    ]
    report = reward_client.score(items, step=step)
    results = iter(report.results)
    scored = [ScoredGroup(r, list(g), [next(results) for _ in g])
              for r, g in zip(records, groups, strict=True)]
    return scored, report.metrics


def advantages(rewards: torch.Tensor, kind: str) -> torch.Tensor:
    """(G, n) rewards -> (G, n) advantages. reinforce_pp and gae: the rewards themselves,
    which the policy update turns into per-token advantages (`rl.update_advantages`)."""
    if kind in ("reinforce_pp", "gae"):
        return rewards.clone()
    if kind == "rloo":
        return rloo(rewards)
    return group_normalized(rewards, scale_by_std=kind == "grpo")


def routed_tensor(sample: Sample) -> torch.Tensor | None:
    """The engine's routed experts of `sample` as (MoE layers, prompt + completion,
    top-k): the last token, which the engine never fed, takes the previous position's
    experts (its output predicts nothing the loss reads)."""
    routed = sample.routed_experts
    if routed is None:
        return None
    dtype = torch.uint8 if routed.width == 1 else torch.int16
    ids = torch.frombuffer(bytearray(routed.ids), dtype=dtype).reshape(routed.shape).long()
    length = len(sample.prompt_token_ids) + len(sample.token_ids)
    if ids.shape[1] != length - 1:
        raise ValueError(f"routed experts cover {ids.shape[1]} positions, expected "
                         f"{length - 1} (the prompt and every generated token but the last)")
    return torch.cat([ids, ids[:, -1:]], dim=1)
