"""One worker thread in front of a static engine: concurrent requests become one batch.

(The continuous backend has its own worker: `continuous_scheduler`.)

HTTP handlers put jobs on a queue; the worker takes the generation jobs at its
head, up to `max_batch` rows (prompt x sample) together (always at least one),
and runs them as one engine call. A weight update is a job too and runs alone,
in arrival order: requests queued before it are answered by the old weights,
requests after it by the new ones, and no batch straddles the two. A job that
was cancelled while it waited (its client gave up) is skipped.

With partial rollouts (`partial=True`, `--partial-rollouts`) an update does not wait
for the running batch: the engine calls back after every decode step and the update
runs there, so generations in flight go on under the new weights (each token records
the version that sampled it) and the trainer's push is not held up by a long
generation; requests still queued then run on the new version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from moerl.rollout.engine import RolloutEngine
from moerl.rollout.types import GenerationRequest, Sample

log = logging.getLogger(__name__)


@dataclass
class _Generate:
    requests: list[GenerationRequest]
    future: Future[list[list[Sample]]] = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)

    @property
    def rows(self) -> int:
        return sum(r.sampling.n for r in self.requests)


@dataclass
class _Update:
    path: Path | str  # a published directory, or what `action` loads
    version: int
    future: Future[int] = field(default_factory=Future)
    action: Callable[[], None] | None = None  # loads the version (None: from `path`)


def run_update(engine: RolloutEngine, job: _Update) -> None:
    """Load the update's version on `engine` and answer its future."""
    if not job.future.set_running_or_notify_cancel():
        return
    try:
        if job.action is not None:
            job.action()
        else:
            engine.load_weights(job.path, job.version)
        job.future.set_result(job.version)
    except Exception as exc:
        log.exception("weight update to version %d from %s failed", job.version, job.path)
        job.future.set_exception(exc)


class JobQueue:
    """The queue of generation and update jobs in front of one engine, and its worker
    thread (`_loop`, the subclass's)."""

    def __init__(self) -> None:
        self._jobs: deque[_Generate | _Update] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._last_arrival = 0.0
        # Set while an update is queued or loading: (target version, since when).
        self.pending_update: tuple[int, float] | None = None
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)

    def _loop(self) -> None:
        raise NotImplementedError

    def submit(self, requests: list[GenerationRequest]) -> Future[list[list[Sample]]]:
        job = _Generate(requests)
        self._put(job)
        return job.future

    def submit_update(self, path: str | Path, version: int,
                      action: Callable[[], None] | None = None) -> Future[int]:
        """Load `version` alone on the engine: from directory `path`, or by `action`
        (then `path` only names the source in logs)."""
        job = _Update(path if action is not None else Path(path), version, action=action)
        with self._wake:
            if self.pending_update is None:
                self.pending_update = (version, time.monotonic())
        self._put(job)
        return job.future

    def _put(self, job: _Generate | _Update) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError("the rollout engine is shut down")
            self._jobs.append(job)
            self._last_arrival = time.monotonic()
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def _next_pending(self) -> None:
        """After an update: the next queued one, if any, is what the server waits for."""
        with self._wake:
            later = [j for j in self._jobs if isinstance(j, _Update)]
            self.pending_update = (later[0].version, time.monotonic()) if later else None


class BatchScheduler(JobQueue):
    """Serialises access to one engine and batches what arrives together."""

    def __init__(self, engine: RolloutEngine, max_batch: int, wait_s: float = 0.05,
                 partial: bool = False) -> None:
        super().__init__()
        self.engine = engine
        if partial:
            engine.between_steps = self._updates_between_steps  # type: ignore[attr-defined]
        self.max_batch = max_batch
        # How long the oldest request may wait for others to fill its batch: requests
        # sent together reach the server a few ms apart, and a static batch cannot
        # take rows in later. The wait ends early once arrivals pause for a quarter of it,
        # so a lone request is delayed by a quarter of it.
        self.wait_s = wait_s
        self.batches_run = 0
        self._thread.start()

    def _next(self) -> list[_Generate] | _Update | None:
        """The update at the head, or the generation jobs that fit one batch."""
        with self._wake:
            while not self._jobs and not self._closed:
                self._wake.wait()
            if not self._jobs:
                return None
            if isinstance(head := self._jobs[0], _Update):
                self._jobs.popleft()
                return head
            while self._queued_rows() < self.max_batch and not self._closed:
                now = time.monotonic()
                left = min(head.arrived + self.wait_s, self._last_arrival + self.wait_s / 4) - now
                if left <= 0:
                    break
                self._wake.wait(left)
            batch: list[_Generate] = []
            rows = 0
            while self._jobs and isinstance(head := self._jobs[0], _Generate):
                if batch and rows + head.rows > self.max_batch:
                    break
                self._jobs.popleft()
                if head.future.set_running_or_notify_cancel():
                    batch.append(head)
                    rows += head.rows
            return batch

    def _queued_rows(self) -> int:
        """Rows of the generation jobs at the head of the queue (up to an update)."""
        rows = 0
        for job in self._jobs:
            if isinstance(job, _Update):
                break
            rows += job.rows
        return rows

    def _loop(self) -> None:
        while (work := self._next()) is not None:
            if isinstance(work, _Update):
                self._run_update(work)
            elif work:
                self._run_batch(work)

    def _run_update(self, job: _Update) -> None:
        try:
            run_update(self.engine, job)
        finally:
            self._next_pending()

    def _updates_between_steps(self) -> None:
        """In the worker thread, inside a generation: run the updates waiting now."""
        while True:
            with self._wake:
                job = next((j for j in self._jobs if isinstance(j, _Update)), None)
                if job is None:
                    return
                self._jobs.remove(job)
            self._run_update(job)

    def _run_batch(self, batch: list[_Generate]) -> None:
        requests = [r for job in batch for r in job.requests]
        try:
            groups = self.engine.generate(requests)
        except Exception as exc:
            log.exception("generation of a batch of %d requests failed", len(requests))
            for job in batch:
                job.future.set_exception(exc)
            return
        self.batches_run += 1
        start = 0
        for job in batch:
            job.future.set_result(groups[start : start + len(job.requests)])
            start += len(job.requests)
