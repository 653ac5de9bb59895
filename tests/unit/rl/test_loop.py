"""The RL loop's control flow with stand-in servers and policy (the real ones are
exercised by the integration and recipe tests): sync and async complete, the
staleness bound holds, infra errors never become training samples."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from stand_in_policy import StandInPolicy, peers

from moerl.data.prompts import PromptRecord, PromptStream
from moerl.observability import LoggerConfig, MetricsLogger, read_metrics
from moerl.rewards.client import ScoreItem, ScoreReport
from moerl.rewards.protocol import RewardResult
from moerl.rl.config import RLConfig
from moerl.rl.loop import Controller, run_steps
from moerl.rollout.types import Sample


class FakeEngines:
    """Serves `version`; each sample's reward is decided by its last token."""

    def __init__(self) -> None:
        self.version = 0
        self.lock = threading.Lock()
        self.calls = 0

    def generate(self, prompts: list[list[int]], n: int, sampling: Any) -> list[list[Sample]]:
        time.sleep(0.01)  # long enough for the trainer to overtake in async mode
        with self.lock:
            self.calls += 1
            version = self.version
        # Sample i has i + 1 tokens before the end of sequence.
        return [[Sample(tuple(p), (i % 3,) * (i + 1) + (257,), (-1.0,) * (i + 2), "stop",
                        version, text=str(i % 3))
                 for i in range(n)] for p in prompts]

    def update_weights(self, path: Path, version: int) -> None:
        with self.lock:
            self.version = version


class FakeJudges:
    def __init__(self, infra_every: int = 0) -> None:
        self.infra_every, self.count = infra_every, 0

    def score(self, items: list[ScoreItem], step: int) -> ScoreReport:
        results = []
        for item in items:
            self.count += 1
            if self.infra_every and self.count % self.infra_every == 0:
                results.append(RewardResult.infra("sandbox died"))
            else:
                results.append(RewardResult(reward=1.0 if item.completion == "2" else 0.0))
        return ScoreReport(results)


class FakePolicy(StandInPolicy):
    def __init__(self) -> None:
        self.trained: list[tuple[int, list[int]]] = []
        self.step = 0

    def train_on(self, samples: list[Any]) -> dict[str, float]:
        self.trained.append((self.step, [s.weight_version for s in samples]))
        self.step += 1
        time.sleep(0.03)
        return {"loss": 0.0}

    def publish(self, directory: str | Path) -> Path:
        return Path(directory)


class FakeSync:
    def __init__(self, rollout_client: FakeEngines) -> None:
        self.rollout_client = rollout_client

    def push(self, policy: Any, version: int) -> None:
        self.rollout_client.update_weights(Path("."), version)


def _run(tmp_path: Path, mode: str, infra_every: int = 0) -> tuple[FakePolicy, list[Any]]:
    rollout_client, policy = FakeEngines(), FakePolicy()
    records = [PromptRecord(f"p{i}", f"prompt {i}", "fake") for i in range(5)]
    ctl = Controller(rollout_client, FakeJudges(infra_every), PromptStream(records), records[:2],  # type: ignore[arg-type]
                     lambda t: [1, 2, 3], MetricsLogger(LoggerConfig(wandb_mode="disabled",
                                                                     plot=False), tmp_path, {}))
    cfg = RLConfig(steps=6, prompts_per_step=2, group_size=4, mode=mode,  # type: ignore[arg-type]
                   max_staleness=1, eval_interval=0)
    run_steps(cfg, peers(policy), FakeSync(rollout_client), ctl)  # type: ignore[arg-type]
    return policy, read_metrics(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_modes_complete_within_the_staleness_bound(tmp_path: Path, mode: str) -> None:
    policy, rows = _run(tmp_path, mode)
    assert [step for step, _ in policy.trained] == list(range(6))
    for step, versions in policy.trained:
        assert versions, "every step trains on informative groups"
        assert all(step - v <= 1 for v in versions)
        if mode == "sync":
            assert set(versions) == {step}  # on-policy
    logged = [r for r in rows if "async/staleness_max_trained" in r]
    assert len(logged) == 6 and max(r["async/staleness_max_trained"] for r in logged) <= 1
    for row in logged:  # group_size 4: 2, 3, 4 and 5 tokens
        assert (row["rollout/response_length"], row["rollout/response_length_p50"],
                row["rollout/response_length_max"]) == (3.5, 3.5, 5.0)
    evals = [r for r in rows if "eval/pass_rate" in r]
    assert len(evals) == 2  # first and last
    assert all(r["time/eval"] > 0 and "time/step" not in r for r in evals)  # apart from steps
    for row in logged:  # the whole step: in sync mode also the collection before training
        phases = row["time/train"] + row["time/sync"]
        if mode == "sync":
            phases += row["time/rollout"] + row["time/reward"]
        assert row["time/step"] >= phases > 0


def test_async_without_staleness_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rl\.max_staleness=0 with rl\.mode=async"):
        RLConfig(mode="async", max_staleness=0)
    assert RLConfig(mode="sync", max_staleness=0).max_staleness == 0


def test_infra_errors_are_counted_and_never_trained(tmp_path: Path) -> None:
    policy, rows = _run(tmp_path, "sync", infra_every=5)
    steps = [r for r in rows if "reward/infra_errors" in r and "eval/pass_rate" not in r]
    assert sum(r["reward/infra_errors"] for r in steps) > 0
    trained = sum(len(v) for _, v in policy.trained)
    collected = 6 * 2 * 4
    assert trained < collected  # the infra-error samples were left out
