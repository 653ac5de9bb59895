"""One worker thread stepping a continuous engine: requests join between steps.

The counterpart of `batching.BatchScheduler` for the continuous backend, with the same
surface for the server. HTTP handlers queue jobs; the worker, between two steps, hands
the engine every generation job queued ahead of the first weight update (they join the
running sequences at once; nothing waits to fill a batch), then runs one step, and
answers each job as soon as all its samples are done.

A weight update is a job too and keeps its place in the queue: jobs queued before it
are answered by the old weights, jobs after it by the new ones. Without partial
rollouts the update waits for the sequences in flight to finish (no new ones start
meanwhile); with them (`partial=True`) it runs at the next step boundary and the
sequences in flight go on under the new weights, every token recording its version.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from moerl.rollout.batching import JobQueue, _Generate, _Update, run_update
from moerl.rollout.types import Sample

if TYPE_CHECKING:
    from moerl.rollout.engine import MegatronEngine

log = logging.getLogger(__name__)


class ContinuousScheduler(JobQueue):
    """Serialises access to one continuous engine and keeps it stepping."""

    def __init__(self, engine: MegatronEngine, partial: bool = False) -> None:
        super().__init__()
        self.engine = engine
        self.partial = partial
        self._in_flight: list[_Generate] = []
        self.steps_run = 0
        self._thread.start()

    def _take(self) -> tuple[list[_Generate], _Update | None] | None:
        """The generation jobs ahead of the first update, and that update when it may run
        now; None once closed."""
        with self._wake:
            while not self._closed and not self._jobs and not self.engine.busy():
                self._wake.wait()
            if self._closed:
                return None
            jobs = []
            while self._jobs and isinstance(head := self._jobs[0], _Generate):
                self._jobs.popleft()
                if head.future.set_running_or_notify_cancel():
                    jobs.append(head)
            update = None
            first = self._jobs[0] if self._jobs else None
            if isinstance(first, _Update) and (self.partial or not (jobs or self.engine.busy())):
                update = first
                self._jobs.popleft()
            return jobs, update

    def _loop(self) -> None:
        while (work := self._take()) is not None:
            jobs, update = work
            for job in jobs:
                self._start(job)
            if update is not None:
                run_update(self.engine, update)
                self._next_pending()
            elif self.engine.busy():
                self._step()
        self._fail_in_flight(RuntimeError("the rollout engine is shut down"))

    def _start(self, job: _Generate) -> None:
        def done(groups: list[list[Sample]]) -> None:
            self._in_flight.remove(job)
            job.future.set_result(groups)

        try:
            self.engine.start(job.requests, done)
        except Exception as exc:  # a request the engine refused
            job.future.set_exception(exc)
            return
        self._in_flight.append(job)

    def _step(self) -> None:
        try:
            self.engine.step()
            self.steps_run += 1
        except Exception as exc:
            log.exception("a step of %d generation job(s) failed", len(self._in_flight))
            self.engine.abandon()
            self._fail_in_flight(exc)

    def _fail_in_flight(self, exc: BaseException) -> None:
        jobs, self._in_flight = self._in_flight, []
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(exc)
