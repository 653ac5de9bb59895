"""Built against planned, term by term, and whether a rank fits its GPU.

A term built on the rank and counted by the planner must agree within `TOLERANCE` of
the larger of the two; a term built that the planner has no term for is a
disagreement too. Terms only the planner counts (activations, logits, dispatch
buffers, reserves) are taken as planned. A rank fits when the larger of built and
planned, summed over its terms, is within its budget; a refusal names the rank, the
total, and the terms without any one of which it would fit (else the largest).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1024**3
TOLERANCE = 0.05


@dataclass
class Rehearsed:
    """One rank: what it built, what the planner counts, and what it may use."""

    stage: str  # "trainer" or "rollout"
    rank: int  # global rank in its stage's job
    pp_rank: int
    same_as: tuple[int, ...]  # pipeline ranks holding the same
    built: dict[str, int]
    planned: dict[str, float]
    budget: float
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.stage} rank {self.rank} (pp {self.pp_rank})"

    def bytes(self, term: str) -> float:
        """What the verdict counts for `term`: the larger of built and planned."""
        return max(float(self.built.get(term, 0)), self.planned.get(term, 0.0))

    @property
    def total(self) -> float:
        return sum(self.bytes(t) for t in {**self.planned, **self.built})


def judge(rank: Rehearsed) -> Rehearsed:
    """Fill `rank.problems`: disagreements, then the fit."""
    for term, built in rank.built.items():
        if term not in rank.planned:
            rank.problems.append(f"{rank.name}: {term} is built ({built / GiB:.2f} GiB) but "
                                 "the planner has no term for it")
            continue
        planned = rank.planned[term]
        larger = max(built, planned)
        if larger and abs(built - planned) > TOLERANCE * larger:
            rank.problems.append(
                f"{rank.name}: {term} built {built / GiB:.2f} GiB, planned "
                f"{planned / GiB:.2f} GiB ({abs(built - planned) / larger:.0%} apart)")
    total = rank.total
    if total > rank.budget:
        terms = {t: rank.bytes(t) for t in {**rank.planned, **rank.built}}
        alone = [t for t, b in sorted(terms.items(), key=lambda kv: -kv[1])
                 if b and total - b <= rank.budget]
        largest = max(terms, key=lambda t: terms[t])
        why = ("it would fit without any one of: "
               + ", ".join(f"{t} ({terms[t] / GiB:.1f} GiB)" for t in alone)
               if alone else f"largest term: {largest} ({terms[largest] / GiB:.1f} GiB)")
        rank.problems.append(f"{rank.name} does not fit: {total / GiB:.1f} GiB > budget "
                             f"{rank.budget / GiB:.1f} GiB; {why}")
    return rank
