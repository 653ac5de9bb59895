"""Requests in, samples out, one step at a time: the continuous engine on one rank or across
the ranks of a server with data-parallel attention.

Across ranks every attention replica (the ranks of one data-parallel index: one rank,
or the tensor-parallel ranks of one copy of the attention) serves its own requests with
its own KV cache; the MoE layers exchange tokens between all ranks through Megatron's
expert-parallel dispatch, so the ranks step together. The leader (rank 0, which serves
HTTP) gives each request, all its samples, to the replica with the least work queued,
and every step is one `tick` command: the requests assigned since the last one, and
whether anyone has work. Each rank adds its replica's requests, runs one forward (a
stand-in token when it has none, so its MoE layers' collectives pair with the others'),
and reports the samples its replica finished and whether it still has work; the leader
hands finished requests back. An EP32 engine is 32 replicas each serving a 32nd of the
requests, not 32 copies of one batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from moerl.rollout.sampling import RowSampling
from moerl.rollout.static_decode import DecodeRow
from moerl.rollout.types import GenerationRequest, Sample

if TYPE_CHECKING:
    from moerl.rollout.ranks import RolloutRanks

RowKey = tuple[int, int, int]  # (job, request in the job, sample of the request)
Assignment = tuple[int, int, int, GenerationRequest]  # (replica, job, request, the request)
Done = Callable[[list[list[Sample]]], None]


class StepDecoder(Protocol):
    """What the runner drives: the continuous decoder, or Megatron's dynamic engine."""

    def add(self, rows: list[DecodeRow]) -> None: ...

    def step(self, forward_anyway: bool = False) -> list[DecodeRow]:
        """One forward (a stand-in one with nothing to run if `forward_anyway`); the rows
        that finished in it."""
        ...

    def has_work(self) -> bool: ...

    def drop_all(self) -> list[DecodeRow]: ...

    def forget_prefixes(self) -> None: ...


@dataclass
class _Job:
    groups: list[list[Sample | None]]
    done: Done
    left: int


@dataclass
class Report:
    """What one rank says after a tick."""

    samples: list[tuple[RowKey, Sample]] = field(default_factory=list)
    busy: bool = False


class ContinuousRunner:
    """Drives a `StepDecoder`; the leader also hands out requests and collects samples."""

    def __init__(self, decoder: StepDecoder, make_sample: Callable[[DecodeRow], Sample],
                 ranks: RolloutRanks | None = None) -> None:
        self.decoder = decoder
        self.make_sample = make_sample
        self.ranks = ranks
        replicas = ranks.replicas if ranks is not None else 1
        self.load = [0] * replicas  # leader: tokens of work queued per replica
        self.served = [0] * replicas  # leader: rows handed to each replica so far
        self._jobs: dict[int, _Job] = {}
        self._next_job = 0
        self._assigned: list[Assignment] = []
        self._rows: dict[int, RowKey] = {}  # id(row) -> its key (this rank's rows)
        self._work: dict[RowKey, tuple[int, int]] = {}  # leader: (replica, tokens) per row
        self._anyone_busy = False

    # -- the leader -------------------------------------------------------------------

    def submit(self, requests: list[GenerationRequest], done: Done) -> None:
        """Queue seeded `requests`; `done` gets their groups of samples, in order."""
        job = self._next_job
        self._next_job += 1
        self._jobs[job] = _Job([[None] * r.sampling.n for r in requests], done,
                               sum(r.sampling.n for r in requests))
        for index, request in enumerate(requests):
            replica = min(range(len(self.load)), key=self.load.__getitem__)
            work = len(request.prompt_token_ids) + request.sampling.max_tokens  # per sample
            self.load[replica] += work * request.sampling.n
            self.served[replica] += request.sampling.n
            for sample in range(request.sampling.n):
                self._work[(job, index, sample)] = (replica, work)
            self._assigned.append((replica, job, index, request))

    def busy(self) -> bool:
        return bool(self._jobs)

    def step(self) -> None:
        """One step of every rank (the leader's call)."""
        assigned, self._assigned = tuple(self._assigned), []
        forward = self._anyone_busy or bool(assigned)
        if self.ranks is not None:
            from moerl.rollout.ranks import Command

            self.ranks.send(Command("tick", assignments=assigned, forward=forward))
        reports = self.tick(assigned, forward)
        self._anyone_busy = any(r.busy for r in reports)
        for report in reports:
            for key, sample in report.samples:
                self._deliver(key, sample)

    def drop_all(self) -> list[Done]:
        """Forget every job (a step failed); their callbacks, for the caller to fail."""
        self.decoder.drop_all()
        self._rows.clear()
        self._work.clear()
        self._assigned.clear()
        self.load = [0] * len(self.load)
        self._anyone_busy = False
        jobs, self._jobs = list(self._jobs.values()), {}
        return [job.done for job in jobs]

    def _deliver(self, key: RowKey, sample: Sample) -> None:
        job_id, index, number = key
        job = self._jobs[job_id]
        job.groups[index][number] = sample
        replica, work = self._work.pop(key)
        self.load[replica] -= work
        job.left -= 1
        if job.left == 0:
            del self._jobs[job_id]
            job.done([[s for s in group if s is not None] for group in job.groups])

    # -- every rank -------------------------------------------------------------------

    def tick(self, assigned: tuple[Assignment, ...], forward: bool) -> list[Report]:
        """Add this replica's new requests, run one forward, report (the leader gets every
        rank's reports, a follower an empty list)."""
        replica = self.ranks.replica if self.ranks is not None else 0
        for target, job, index, request in assigned:
            if target == replica:
                self._add(job, index, request)
        finished = self.decoder.step(forward_anyway=self.ranks is not None) if forward else []
        report = Report(busy=self.decoder.has_work())
        for row in finished:
            key = self._rows.pop(id(row))
            if self.ranks is None or self.ranks.reports_samples:
                report.samples.append((key, self.make_sample(row)))
        if self.ranks is None:
            return [report]
        return self.ranks.gather_reports(report)

    def _add(self, job: int, index: int, request: GenerationRequest) -> None:
        seed = request.sampling.seed
        assert seed is not None, "requests are seeded before they are queued"
        prompt = list(request.prompt_token_ids)
        rows = [DecodeRow(list(prompt), RowSampling.make(request.sampling, seed, i))
                for i in range(request.sampling.n)]
        for number, row in enumerate(rows):
            self._rows[id(row)] = (job, index, number)
        self.decoder.add(rows)
