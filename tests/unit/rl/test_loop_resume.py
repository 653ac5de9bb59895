"""What the loop reports after each step for a checkpoint (`StepEnd`), with the
stand-in servers of test_loop: a run resumed from any step's report takes the same
prompts for every later step, in sync and in async mode (where batches for later
steps may already be collected), and evaluates on the same schedule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from stand_in_policy import peers
from test_loop import FakeEngines, FakeJudges, FakePolicy, FakeSync

from moerl.data.prompts import PromptRecord, PromptStream
from moerl.observability import LoggerConfig, MetricsLogger, read_metrics
from moerl.rl.config import RLConfig
from moerl.rl.loop import Controller, StepEnd, run_steps
from moerl.rollout.types import Sample

STEPS = 6


class RecordingEngines(FakeEngines):
    """Remembers which prompts each step's rollouts (told apart by their seed) got."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: dict[int, list[int]] = {}

    def generate(self, prompts: list[list[int]], n: int, sampling: Any) -> list[list[Sample]]:
        if sampling.temperature > 0:  # evaluations are greedy
            self.prompts.setdefault(sampling.seed, []).extend(p[0] for p in prompts)
        return super().generate(prompts, n, sampling)


def _run(tmp_path: Path, mode: str, start: int = 0, prompts: dict[str, int] | None = None
         ) -> tuple[dict[int, list[int]], list[StepEnd], list[int]]:
    engines = RecordingEngines()
    records = [PromptRecord(f"p{i}", f"prompt {i}", "fake") for i in range(5)]
    stream = PromptStream(records, seed=3)
    if prompts is not None:
        stream.restore(prompts)
    logger = MetricsLogger(LoggerConfig(wandb_mode="disabled", plot=False), tmp_path, {})
    ctl = Controller(engines, FakeJudges(), stream, records[:2],  # type: ignore[arg-type]
                     lambda record: [int(record.prompt.split()[-1])], logger)
    cfg = RLConfig(steps=STEPS, prompts_per_step=2, group_size=4, mode=mode,  # type: ignore[arg-type]
                   max_staleness=1, eval_interval=2)
    ends: list[StepEnd] = []
    engines.update_weights(Path("."), start)
    run_steps(cfg, peers(FakePolicy()), FakeSync(engines), ctl, start_step=start,  # type: ignore[arg-type]
          on_step_end=ends.append)
    evals = [int(r["step"]) for r in read_metrics(logger.path) if "eval/pass_rate" in r]
    return engines.prompts, ends, evals


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_from_any_step_end_takes_the_same_prompts(tmp_path: Path, mode: str) -> None:
    whole, ends, evals = _run(tmp_path / "whole", mode)
    assert [e.step for e in ends] == list(range(STEPS))
    assert evals == [0, 2, 4, STEPS]
    if mode == "sync":
        assert all(e.collected_ahead == 0 for e in ends)
    else:  # the producer runs ahead while a step trains (30 ms against 10 ms)
        assert any(e.collected_ahead for e in ends)
    for end in ends[:-1]:
        assert end.prompts is not None
        resumed, _, evals = _run(tmp_path / f"from{end.step}", mode, end.step + 1, end.prompts)
        later = {seed: p for seed, p in whole.items() if seed > end.step}
        assert resumed == later, f"resumed after step {end.step}"
        expected = [s for s in (2, 4) if s > end.step] + [STEPS]
        assert evals == expected  # no extra evaluation where the run resumed
