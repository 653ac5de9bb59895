"""A stand-in for `rl.policy.Policy` in the loop's tests: it packs each minibatch as its
samples, computes no logprobs and trains on nothing; `train_on` sees the samples of each
update the loop runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moerl.data.rl_batch import RLSample
from moerl.rl.peers import Peers


class StandInPolicy:
    def pack(self, samples: Sequence[RLSample]) -> list[RLSample]:
        return list(samples)

    def old_logprobs(self, micro: Sequence[Any], first: bool = True) -> None:
        return None

    def denominator(self, micro: Sequence[Any]) -> None:
        return None

    def update(self, prepared: Sequence[Any]) -> dict[str, float]:
        return self.train_on([s for p in prepared for s in p.micro])

    def train_on(self, samples: list[RLSample]) -> dict[str, float]:
        """The update's metrics; `samples`: what it trains on (every minibatch's)."""
        return {}


def peers(policy: StandInPolicy) -> Peers:
    """`policy` as the loop's peers, with no reference model and no critic."""
    return Peers(policy)  # type: ignore[arg-type]
