"""The server's scorer runs each item id once (RELIABILITY.md case 14 at unit level)."""

import asyncio
import threading
import time
from collections.abc import Mapping
from typing import Any

from moerl.rewards.protocol import RewardResult
from moerl.rewards.server import ScoreItem, Scorer


class SlowCounter:
    name = "count"

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def score(self, completion: str, spec: Mapping[str, Any]) -> RewardResult:
        with self.lock:
            self.calls += 1
        time.sleep(0.2)
        if spec.get("explode"):
            raise RuntimeError("reward bug")
        return RewardResult(reward=1.0)


def test_same_id_is_executed_once_and_errors_are_typed() -> None:
    counter = SlowCounter()
    scorer = Scorer({"count": counter}, max_concurrency=2)
    item = ScoreItem(id="a", reward="count", completion="x")

    async def scenario() -> list[RewardResult]:
        first = asyncio.ensure_future(scorer.score(item))
        await asyncio.sleep(0.05)
        first.cancel()  # the client gave up; the execution goes on
        again = await asyncio.gather(scorer.score(item), scorer.score(item))
        later = await scorer.score(item)
        reused = await scorer.score(ScoreItem(id="a", reward="count", completion="other"))
        unknown = await scorer.score(ScoreItem(id="b", reward="nope", completion=""))
        boom = await scorer.score(
            ScoreItem(id="c", reward="count", completion="", spec={"explode": 1})
        )
        return [*again, later, reused, unknown, boom]

    r1, r2, r3, reused, unknown, boom = asyncio.run(scenario())
    assert counter.calls == 2  # "a" once, "c" once
    assert r1.reward == r2.reward == r3.reward == 1.0
    assert reused.error_kind == "invalid_spec" and unknown.error_kind == "invalid_spec"
    assert boom.reward is None and boom.error_kind == "infra" and "reward bug" in (boom.error or "")
