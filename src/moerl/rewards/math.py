"""Math answers checked with math-verify: the gold answer and the completion are parsed
(LaTeX, \\boxed{...}, plain expressions) and compared symbolically.

Parsing and comparing run in persistent child processes (`math_worker.py`, a
`WorkerPool`) under a wall-clock deadline, so the deadline holds in any thread of the
reward server (math-verify's own timeouts use SIGALRM, which works in the main thread
only) and even for work stuck in C code: a worker past its deadline is killed and
replaced. A completion that runs out the deadline scores 0.0 (details["timed_out"]):
an answer too pathological to check is a wrong answer, not a failure of the system.
A worker that crashes on a completion is given a second try on a fresh worker; a
second crash scores 0.0 too (details["crashed"]). Workers that cannot start at all
are an infra failure (the server reports the raised error).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from moerl.rewards.protocol import InvalidSpec, RewardResult
from moerl.rewards.worker_pool import WorkerDied, WorkerPool, WorkerTimeout

# Very long completions make the parser slow; the answer is at the end.
_MAX_CHARS = 8000


def _default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class MathReward:
    """spec: {"answer": str (LaTeX or plain), "require_boxed"?: bool}. Reward 1.0 when
    the completion's final answer is equivalent to the gold answer, else 0.0 (also when
    checking it takes longer than `timeout_s` seconds, and, with `require_boxed`, when
    the completion has no \\boxed{...}: math-verify would otherwise take a bare final
    number). `workers` child processes at most, each capped at `memory_mb` of address
    space. Thread-safe; `close()` ends the workers (they also end with this object and
    with the process)."""

    name = "math"

    def __init__(self, sandbox: object | None = None, timeout_s: float = 5.0,
                 workers: int | None = None, memory_mb: int = 2048) -> None:  # fmt: skip
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if importlib.util.find_spec("math_verify") is None:
            raise ImportError("MathReward needs math-verify (the `rewards` extra)")
        self.timeout_s = timeout_s
        self._pool = WorkerPool("moerl.rewards.math_worker", (str(memory_mb),),
                                max_workers=workers or _default_workers())  # fmt: skip

    def worker_pids(self) -> list[int]:
        """Process ids of the checking processes running now."""
        return self._pool.pids()

    def close(self) -> None:
        """Kill the checking processes; scoring afterwards raises PoolClosed."""
        self._pool.close()

    def score(self, completion: str, spec: Mapping[str, Any]) -> RewardResult:
        answer = spec.get("answer")
        if not isinstance(answer, str) or not answer.strip():
            raise InvalidSpec("spec['answer'] must be a non-empty string")
        tail = completion[-_MAX_CHARS:]
        if spec.get("require_boxed") and "\\boxed" not in tail:
            return RewardResult(reward=0.0, details={"boxed": False})
        gold = answer if ("\\boxed" in answer or "$" in answer) else f"${answer}$"
        request = {"gold": gold, "completion": tail}
        reply: dict[str, Any] | None = None
        for _attempt in range(2):
            try:
                reply = self._pool.call(request, self.timeout_s)
                break
            except WorkerTimeout:
                return RewardResult(reward=0.0, status="timeout",
                                    details={"timed_out": True, "timeout_s": self.timeout_s})
            except WorkerDied:
                continue
        if reply is None:
            return RewardResult(reward=0.0, details={"crashed": True})
        if not reply.get("gold_ok"):
            why = f" ({reply['error']})" if reply.get("error") else ""
            raise InvalidSpec(f"gold answer {answer!r} cannot be parsed{why}")
        return RewardResult(
            reward=1.0 if reply.get("correct") is True else 0.0,
            details={"parsed": str(reply.get("parsed")), "gold": str(reply.get("gold_parsed")),
                     "error": str(reply.get("error"))},
        )  # fmt: skip
