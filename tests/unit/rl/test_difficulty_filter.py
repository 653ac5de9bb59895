"""The online difficulty filter (`rl.difficulty_filter_epochs`): a prompt whose group was
all solved or all failed sits out the next epochs, then comes back; counted, logged,
resumable. The prompt stream on its own, and the RL loop with a scripted policy (its
answers fixed per prompt) and stand-in servers."""

from __future__ import annotations

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

# what each prompt's samples answer: every one right, every one wrong, or half and half
SCRIPT = {"easy": ("right", "right"), "hard": ("wrong", "wrong"),
          "mixed-a": ("right", "wrong"), "mixed-b": ("wrong", "right")}


def _records() -> list[PromptRecord]:
    return [PromptRecord(name, name, "fake") for name in SCRIPT]


def test_settled_prompts_sit_out_then_come_back() -> None:
    stream = PromptStream(_records(), seed=3, set_aside_epochs=1)
    first = stream.take(4)
    assert {r.uid for r in first} == set(SCRIPT)
    for r in first:
        stream.settle(r, [1.0 if a == "right" else 0.0 for a in SCRIPT[r.uid]])
    assert stream.counts["solved"] == 1 and stream.counts["failed"] == 1
    assert stream.metrics()["data/set_aside"] == 2.0
    second = stream.take(2)  # epoch 1: only the two still informative
    assert {r.uid for r in second} == {"mixed-a", "mixed-b"}
    assert stream.counts["skipped"] == 2
    third = stream.take(4)  # epoch 2: the settled ones are back
    assert {r.uid for r in third} == set(SCRIPT) and not stream.aside


def test_the_filter_state_resumes_exactly() -> None:
    stream = PromptStream(_records(), seed=3, set_aside_epochs=2)
    for r in stream.take(4):
        stream.settle(r, [1.0 if a == "right" else 0.0 for a in SCRIPT[r.uid]])
    saved = stream.state()
    resumed = PromptStream(_records(), seed=3, set_aside_epochs=2)
    resumed.restore(saved)
    assert [r.uid for r in resumed.take(6)] == [r.uid for r in stream.take(6)]
    assert resumed.counts == stream.counts


def test_when_every_prompt_is_set_aside_the_stream_does_not_stall() -> None:
    records = [PromptRecord("easy", "easy", "fake"), PromptRecord("hard", "hard", "fake")]
    stream = PromptStream(records, set_aside_epochs=5)
    for r in stream.take(2):
        stream.settle(r, [1.0, 1.0] if r.uid == "easy" else [0.0, 0.0])
    assert len(stream.take(2)) == 2 and stream.counts["exhausted"] >= 1


def test_off_by_default_and_refused_for_agent_tasks() -> None:
    stream = PromptStream(_records())
    for r in stream.take(4):
        stream.settle(r, [1.0, 1.0])
    assert not stream.aside and stream.metrics() == {}
    with pytest.raises(ValueError, match=r"rl\.difficulty_filter_epochs"):
        RLConfig(task_source="agent", difficulty_filter_epochs=1)


class ScriptedEngines:
    """Each prompt's samples answer as SCRIPT says; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def generate(self, prompts: list[list[int]], n: int, sampling: Any) -> list[list[Sample]]:
        names = [bytes(p).decode() for p in prompts]
        self.asked.append(names)
        return [[Sample(tuple(p), (1, 2), (-1.0, -1.0), "stop", 0, text=SCRIPT[name][i % 2])
                 for i in range(n)] for p, name in zip(prompts, names, strict=True)]


class Judges:
    def score(self, items: list[ScoreItem], step: int) -> ScoreReport:
        return ScoreReport([RewardResult(reward=1.0 if i.completion == "right" else 0.0)
                            for i in items])


class Policy(StandInPolicy):
    def train_on(self, samples: list[Any]) -> dict[str, float]:
        return {"loss": 0.0}


class NoSync:
    def push(self, policy: Any, version: int) -> None:
        pass


def test_the_loop_spends_no_samples_on_settled_prompts(tmp_path: Path) -> None:
    engines = ScriptedEngines()
    stream = PromptStream(_records(), seed=1, set_aside_epochs=1)
    ctl = Controller(engines, Judges(), stream, [], lambda r: list(r.prompt.encode()),  # type: ignore[arg-type]
                     MetricsLogger(LoggerConfig(wandb_mode="disabled", plot=False), tmp_path, {}))
    # two prompts a step: epoch 0 is steps 0-1, epoch 1 (two prompts left) step 2,
    # epoch 2 steps 3-4
    cfg = RLConfig(steps=5, prompts_per_step=2, group_size=2, dynamic_sampling=False,
                   difficulty_filter_epochs=1, eval_interval=0)
    run_steps(cfg, peers(Policy()), NoSync(), ctl)  # type: ignore[arg-type]
    asked = [set(names) for names in engines.asked]
    assert asked[0] | asked[1] == set(SCRIPT)
    assert asked[2] == {"mixed-a", "mixed-b"}  # the settled two sat out epoch 1
    assert asked[3] | asked[4] == set(SCRIPT)  # and came back in epoch 2
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "data/set_aside" in r]
    assert [r["data/skipped_total"] for r in rows] == [0.0, 0.0, 2.0, 2.0, 2.0]
    assert rows[-1]["data/solved_total"] == 2.0 and rows[-1]["data/failed_total"] == 2.0
