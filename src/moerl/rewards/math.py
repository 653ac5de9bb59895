"""Math answers checked with math-verify: the gold answer and the completion are parsed
(LaTeX, \\boxed{...}, plain expressions) and compared symbolically."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from moerl.rewards.protocol import InvalidSpec, RewardResult

# Very long completions make the parser slow; the answer is at the end.
_MAX_CHARS = 8000


class MathReward:
    """spec: {"answer": str} (LaTeX or plain). Reward 1.0 when the completion's final
    answer is equivalent to the gold answer, else 0.0."""

    name = "math"

    def __init__(self, sandbox: object | None = None) -> None:
        from math_verify import parse, verify  # optional dependency: the `rewards` extra

        self._parse, self._verify = parse, verify

    def score(self, completion: str, spec: Mapping[str, Any]) -> RewardResult:
        answer = spec.get("answer")
        if not isinstance(answer, str) or not answer.strip():
            raise InvalidSpec("spec['answer'] must be a non-empty string")
        # math-verify's own timeouts use SIGALRM, which only works in the main thread;
        # elsewhere (the server's worker threads) they are turned off.
        main = threading.current_thread() is threading.main_thread()
        timeout = 5 if main else None
        wrapped = answer if ("\\boxed" in answer or "$" in answer) else f"${answer}$"
        gold = self._parse(wrapped, parsing_timeout=timeout)
        if not gold:
            raise InvalidSpec(f"gold answer {answer!r} cannot be parsed")
        predicted = self._parse(completion[-_MAX_CHARS:], parsing_timeout=timeout)
        correct = bool(predicted) and bool(self._verify(gold, predicted, timeout_seconds=timeout))
        return RewardResult(
            reward=1.0 if correct else 0.0,
            details={"parsed": str(predicted[:2])[:200], "gold": str(gold[:2])[:200]},
        )
