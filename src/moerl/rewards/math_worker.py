"""The child process that parses and verifies math answers for `MathReward`.

Run as `python -m moerl.rewards.math_worker PARENT_PID MEMORY_MB` by a `WorkerPool`
(worker_pool.py). It gets SIGKILL when its parent thread ends, caps its address
space at MEMORY_MB, writes {"ready": true} once math-verify is loaded, then answers
each request line {"gold": str, "completion": str} on stdin with one line

    {"gold_ok": bool, "correct": bool, "parsed": str, "gold_parsed": str, "error": str}

on the stdout it started with (anything else printed goes to stderr). It imports
math-verify (sympy) and the standard library only: no torch.

math-verify's own timeouts (SIGALRM) stay off: the parent enforces a wall-clock
deadline by killing this process, which also ends work stuck in C code.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import sys
from typing import Any, BinaryIO

from moerl.parent_death import die_with_parent


def check(gold: str, completion: str) -> dict[str, Any]:
    """Parse `gold` and `completion` with math-verify and compare them symbolically."""
    from math_verify import parse, verify

    reply: dict[str, Any] = {"gold_ok": False, "correct": False, "parsed": "",
                             "gold_parsed": "", "error": ""}  # fmt: skip
    try:
        gold_parsed = parse(gold, parsing_timeout=None)
    except Exception as exc:  # reported: the gold answer is unusable
        reply["error"] = f"gold: {type(exc).__name__}: {exc}"[:300]
        return reply
    reply["gold_ok"] = bool(gold_parsed)
    reply["gold_parsed"] = str(gold_parsed[:2])[:200]
    if not gold_parsed:
        return reply
    try:
        predicted = parse(completion, parsing_timeout=None)
        reply["parsed"] = str(predicted[:2])[:200]
        reply["correct"] = bool(predicted) and bool(
            verify(gold_parsed, predicted, timeout_seconds=None))
    except Exception as exc:  # e.g. MemoryError: the answer counts as wrong
        reply["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return reply


def _serve(requests: BinaryIO, replies: BinaryIO) -> None:
    for line in requests:
        request = json.loads(line)
        reply = check(str(request["gold"]), str(request["completion"]))
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()


def main(argv: list[str]) -> None:
    parent_pid, memory_mb = int(argv[0]), int(argv[1])
    die_with_parent(parent_pid, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints of the libraries must not corrupt the replies
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # It warns that timeouts are off: they are, on purpose (see above).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    check("1", "\\boxed{1}")  # loads the parsers before "ready", not within a deadline
    replies.write(b'{"ready": true}\n')
    replies.flush()
    _serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main(sys.argv[1:])
