"""The wait before a client's next attempt, shared by the rollout and reward clients."""

from __future__ import annotations

import random


def backoff_s(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Seconds before retry number `attempt` + 1 (attempt 0 is the first retry): jittered
    in [ceiling/2, ceiling] where ceiling = min(cap, base * 2**attempt), so retries of many
    clients spread out and never come at once, nor wait zero."""
    ceiling = min(cap, base * 2**attempt)
    return ceiling * (0.5 + 0.5 * rng.random())
