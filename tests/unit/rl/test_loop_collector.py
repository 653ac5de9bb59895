"""The loop's collect strategy is pluggable (`Controller.collector`): agent episodes
replace single-shot prompts without a second loop. Fakes stand in for the servers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moerl.data.prompts import PromptStream
from moerl.data.rl_batch import RLSample
from moerl.observability import LoggerConfig, MetricsLogger, read_metrics
from moerl.rl.batch import Batch
from moerl.rl.config import RLConfig
from moerl.rl.loop import Controller, train


class RecordingPolicy:
    def __init__(self) -> None:
        self.batches: list[list[RLSample]] = []

    def update(self, samples: list[RLSample], num_minibatches: int = 1) -> dict[str, float]:
        self.batches.append(samples)
        return {"tokens": float(sum(int(s.loss_mask.sum()) for s in samples
                                    if s.loss_mask is not None))}  # fmt: skip


class NoSync:
    def push(self, policy: Any, version: int) -> None:
        pass


def _episode_sample(version: int) -> RLSample:
    # prompt | model (3 tokens) | observation (2) | model (1): loss on 4 of 6
    return RLSample(torch.tensor([1, 2]), torch.tensor([5, 6, 7, 8, 9, 10]), advantage=1.0,
                    rollout_logprobs=torch.tensor([-1.0, -1.0, -1.0, 0.0, 0.0, -1.0]),
                    loss_mask=torch.tensor([1.0, 1, 1, 0, 0, 1]), weight_version=version)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_controller_collector_replaces_prompt_collect(tmp_path: Path, mode: str) -> None:
    calls: list[int] = []

    def collector(ctl: Controller, cfg: RLConfig, step: int) -> Batch:
        calls.append(step)
        return Batch([_episode_sample(step), _episode_sample(step)], {"agent/turns": 2.0})

    logger = MetricsLogger(LoggerConfig(wandb_mode="disabled", plot=False), tmp_path, {})
    ctl = Controller(None, None, PromptStream([]), [], lambda t: [], logger,  # type: ignore[arg-type]
                     collector=collector)
    policy = RecordingPolicy()
    cfg = RLConfig(steps=3, prompts_per_step=1, group_size=2, mode=mode,  # type: ignore[arg-type]
                   eval_interval=0)
    train(cfg, policy, NoSync(), ctl)  # type: ignore[arg-type]
    assert calls == [0, 1, 2]
    assert [len(b) for b in policy.batches] == [2, 2, 2]
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/tokens" in r]
    assert [r["train/tokens"] for r in rows] == [8.0] * 3  # model tokens only
    assert all(r["agent/turns"] == 2.0 for r in rows)
