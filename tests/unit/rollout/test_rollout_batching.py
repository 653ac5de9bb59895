"""The engine worker: batching of concurrent requests, updates that split batches cleanly."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

from moerl.rollout.batching import BatchScheduler
from moerl.rollout.types import GenerationRequest, Sample, SamplingParams


class FakeEngine:
    """Answers every prompt with its own ids; records each batch and holds a gate."""

    def __init__(self) -> None:
        self.weight_version = 0
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        self.gate.wait()
        self.batches.append(sum(r.sampling.n for r in requests))
        return [[Sample(r.prompt_token_ids, r.prompt_token_ids, (0.0,), "length",
                        self.weight_version)] * r.sampling.n for r in requests]

    def load_weights(self, path: str | Path, version: int) -> None:
        time.sleep(0.05)  # a load that takes a while
        self.weight_version = version


def _request(i: int, n: int = 1) -> list[GenerationRequest]:
    return [GenerationRequest((i,), SamplingParams(n=n))]


def test_waiting_requests_share_batches_up_to_max_rows() -> None:
    engine = FakeEngine()
    scheduler = BatchScheduler(engine, max_batch=4)
    engine.gate.clear()  # the first batch blocks; the rest queue up behind it
    first = scheduler.submit(_request(0))
    time.sleep(0.05)
    futures = [scheduler.submit(_request(i, n=2)) for i in range(1, 6)]
    engine.gate.set()
    assert first.result(5)[0][0].token_ids == (0,)
    assert [f.result(5)[0][0].token_ids for f in futures] == [(i,) for i in range(1, 6)]
    assert engine.batches == [1, 4, 4, 2]
    scheduler.close()


def test_update_splits_batches_and_cancelled_jobs_are_skipped() -> None:
    engine = FakeEngine()
    scheduler = BatchScheduler(engine, max_batch=32)
    engine.gate.clear()
    before = [scheduler.submit(_request(i)) for i in range(3)]
    update = scheduler.submit_update("/nowhere", 7)
    assert scheduler.pending_update is not None and scheduler.pending_update[0] == 7
    after = [scheduler.submit(_request(i)) for i in range(3)]
    dropped = scheduler.submit(_request(99))
    assert dropped.cancel()
    engine.gate.set()
    assert update.result(5) == 7
    assert {f.result(5)[0][0].weight_version for f in before} == {0}
    assert {f.result(5)[0][0].weight_version for f in after} == {7}
    assert sum(engine.batches) == 6  # the cancelled request never ran
    assert scheduler.pending_update is None
    scheduler.close()
