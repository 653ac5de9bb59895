"""A mixture of domains: each step's prompts drawn by weight, deterministically and
resumably (`data.source=mixture`, `data.mixture`, `data.domains`).

A draw of `count` prompts is systematic sampling over the weights: one uniform offset u
from the draw's seed, positions (u + k) / count for k < count mapped through the
cumulative weights, so a domain of weight share w gets floor or ceil of count * w
prompts in every draw (by weight, with the least spread a fixed count allows); the
order of the draw is then shuffled. Each domain keeps its own `PromptStream` (its
epochs, its difficulty filter), and the mixture's state is the number of draws made
plus every domain's stream state: a resume continues the same sequence of domains and
prompts.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moerl.data.domains import Generator
from moerl.data.prompts import DataConfig, DatasetError, LoadReport, PromptRecord, PromptStream


def load_mixture(cfg: DataConfig, sources: Mapping[str, Generator],
                 tokens: Callable[[PromptRecord], int] | None = None,
                 ) -> tuple[list[PromptRecord], list[PromptRecord], LoadReport]:
    """Every weighted domain's (train, held-out) records, concatenated in the mixture's
    order; the report sums the domains'. `tokens` counts a prompt's tokens (default:
    its bytes, an upper bound)."""
    from moerl.data.domains.registry import bytes_upper_bound, domain_records

    train, held_out, report = [], [], LoadReport()
    for name in cfg.mixture:
        got = domain_records(name, cfg.domains[name], cfg.seed, cfg.max_prompt_tokens,
                             cfg.strict, sources, tokens or bytes_upper_bound)
        train += got.train
        held_out += got.held_out
        report.loaded += got.report.loaded
        for why, count in got.report.dropped.items():
            report.dropped[f"{name}: {why}"] = count
    return train, held_out, report


@dataclass
class MixtureStream:
    """The `PromptStream` interface over several domains' streams, drawn by weight."""

    streams: dict[str, PromptStream]
    weights: dict[str, float]
    seed: int = 0
    draws: int = 0
    taken: dict[str, int] = field(default_factory=dict)
    """domain -> prompts taken from it so far (in the checkpoint with the rest)."""

    @classmethod
    def of(cls, records: Sequence[PromptRecord], weights: Mapping[str, float], seed: int,
           set_aside_epochs: int = 0) -> MixtureStream:
        by_domain: dict[str, list[PromptRecord]] = {name: [] for name in weights}
        for record in records:
            if record.domain not in by_domain:
                raise DatasetError(f"record {record.uid}: domain {record.domain!r} is not in "
                                   f"the mixture {sorted(by_domain)}")
            by_domain[record.domain].append(record)
        empty = [name for name, rs in by_domain.items() if weights[name] > 0 and not rs]
        if empty:
            raise DatasetError(f"data.domains.{empty[0]}: no prompts to draw from")
        streams = {name: PromptStream(rs, seed=seed + index, set_aside_epochs=set_aside_epochs)
                   for index, (name, rs) in enumerate(by_domain.items()) if rs}
        return cls(streams, {k: float(v) for k, v in weights.items() if k in streams}, seed)

    def _domains(self, count: int) -> list[str]:
        rng = random.Random(f"mixture:{self.seed}:{self.draws}")
        names = [n for n, w in self.weights.items() if w > 0]
        total = sum(self.weights[n] for n in names)
        edges = list(itertools.accumulate(self.weights[n] / total for n in names))
        u = rng.random()
        chosen = [names[min(bisect.bisect_right(edges, (u + k) / count), len(names) - 1)]
                  for k in range(count)]
        rng.shuffle(chosen)
        return chosen

    def take(self, count: int) -> list[PromptRecord]:
        out = []
        for name in self._domains(count):
            out += self.streams[name].take(1)
            self.taken[name] = self.taken.get(name, 0) + 1
        self.draws += 1
        return out

    def settle(self, record: PromptRecord, rewards: Sequence[float | None]) -> None:
        stream = self.streams.get(record.domain)
        if stream is not None:
            stream.settle(record, rewards)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, stream in self.streams.items():
            for key, value in stream.metrics().items():
                out[key] = out.get(key, 0.0) + value
                out[f"{key.replace('data/', 'domain_')}/{name}"] = value
            out[f"domain_prompts_total/{name}"] = float(self.taken.get(name, 0))
        return out

    def state(self) -> dict[str, Any]:
        return {"mixture": {"seed": self.seed, "draws": self.draws, "weights": self.weights,
                            "taken": dict(self.taken)},
                "domains": {name: s.state() for name, s in self.streams.items()}}

    def restore(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue where `state()` was taken. With `strict`, another mixture (weights,
        domains or seed) is refused: the draws would not continue the same sequence."""
        mix, domains = state.get("mixture"), state.get("domains")
        if not isinstance(mix, dict) or not isinstance(domains, dict):
            raise DatasetError("prompt stream state: not a mixture's state (data.source "
                               "changed to mixture?); resume=none starts afresh")
        if strict:
            for key, ours in (("seed", self.seed), ("weights", self.weights)):
                if mix.get(key) != ours:
                    raise DatasetError(
                        f"mixture state: saved {key} {mix.get(key)!r} != this run's {ours} "
                        "(data.mixture or data.seed changed); the saved draws do not "
                        "continue this mixture")
        self.draws = int(mix.get("draws", 0))
        self.taken = {str(k): int(v) for k, v in (mix.get("taken") or {}).items()}
        for name, stream in self.streams.items():
            if name in domains:
                stream.restore(domains[name], strict)
            elif strict:
                raise DatasetError(f"mixture state: no saved stream for domain {name!r}")
