"""From generated groups to training samples: rewards, filtering, advantages.

Infra errors (sandbox or reward-server failures) are kept apart from model
failures all the way: such a sample gets no reward, is never trained on, and is
counted in `reward/infra_errors`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moerl.data.prompts import PromptRecord
from moerl.data.rl_batch import RLSample
from moerl.rewards.client import RewardClient, ScoreItem
from moerl.rewards.protocol import RewardResult
from moerl.rl.advantages import group_normalized, rloo
from moerl.rl.config import RLConfig
from moerl.rollout.types import Sample


@dataclass
class ScoredGroup:
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
    def informative(self) -> bool:
        return has_spread(self.rewards())


def has_spread(rewards: Sequence[float | None]) -> bool:
    """Whether a group's rewards differ (at least two scored, not all equal): only then
    do group-relative advantages give it a gradient."""
    valid = [r for r in rewards if r is not None]
    return len(valid) >= 2 and max(valid) > min(valid)


def overlong_penalty(sample: Sample, cfg: RLConfig) -> float:
    """DAPO's soft penalty: 0 until max_tokens - buffer, then linear up to the penalty."""
    if not cfg.overlong_buffer:
        return 0.0
    start = cfg.sampling.max_tokens - cfg.overlong_buffer
    over = len(sample.token_ids) - start
    return cfg.overlong_penalty * min(max(over, 0) / cfg.overlong_buffer, 1.0)


def score_groups(
    judges: RewardClient, records: Sequence[PromptRecord], groups: Sequence[list[Sample]],
    step: int,
) -> tuple[list[ScoredGroup], dict[str, float]]:
    """Score every sample of every group in one batched call to the reward servers."""
    items = [
        ScoreItem(record.reward, sample.text, record.spec)
        for record, group in zip(records, groups, strict=True)
        for sample in group
    ]
    report = judges.score(items, step=step)
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


def training_samples(groups: Sequence[ScoredGroup], cfg: RLConfig,
                     first_group_id: int = 0) -> list[RLSample]:
    """Samples with advantages; infra-error samples are left out of their group."""
    out: list[RLSample] = []
    for gid, group in enumerate(groups, start=first_group_id):
        pairs = [(s, r) for s, r in zip(group.samples, group.rewards(cfg), strict=True)
                 if r is not None]
        if len(pairs) < 2:
            continue
        adv = advantages(torch.tensor([[r for _, r in pairs]], dtype=torch.float32), cfg.advantage)
        for (sample, reward), a in zip(pairs, adv[0].tolist(), strict=True):
            out.append(RLSample(
                prompt_ids=torch.tensor(sample.prompt_token_ids, dtype=torch.int64),
                completion_ids=torch.tensor(sample.token_ids, dtype=torch.int64),
                advantage=float(a),
                rollout_logprobs=torch.tensor(sample.logprobs, dtype=torch.float32),
                reward=reward,
                weight_version=sample.weight_version,
                group_id=gid,
                routed_experts=routed_tensor(sample),
                token_versions=None if sample.token_versions is None
                else torch.tensor(sample.token_versions, dtype=torch.int64),
            ))
    return out


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


def group_metrics(groups: Sequence[ScoredGroup], cfg: RLConfig) -> dict[str, float]:
    rewards = [r for g in groups for r in g.rewards(cfg) if r is not None]
    results = [res for g in groups for res in g.results]
    passed = [res.reward == 1.0 for res in results if res.reward is not None]
    lengths = [len(s.token_ids) for g in groups for s in g.samples]
    finished = [s.finish_reason == "stop" for g in groups for s in g.samples]
    metrics = {
        "reward/mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward/pass_rate": statistics.fmean(passed) if passed else 0.0,
        "reward/infra_errors": float(sum(res.error_kind is not None for res in results)),
        "rollout/response_length": statistics.fmean(lengths) if lengths else 0.0,
        "rollout/response_length_max": float(max(lengths, default=0)),
        "rollout/response_length_p50": statistics.median(lengths) if lengths else 0.0,
        "rollout/stop_fraction": statistics.fmean(finished) if finished else 0.0,
        "rollout/informative_groups": float(sum(g.informative for g in groups)),
    }
    compiled = [res.compile_ok for res in results if res.compile_ok is not None]
    if compiled:
        metrics["reward/compile_rate"] = statistics.fmean(compiled)
    return metrics
