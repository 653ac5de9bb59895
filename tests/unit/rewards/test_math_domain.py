"""The `math` domain graded by the real `math` reward: references pass, wrong and
malformed answers do not; math-verify's deadline holds in worker threads; the checking
processes never outlive their owner; generator determinism and option errors."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import pytest

from moerl.data.domains.math_kinds import KINDS, latex
from moerl.data.domains.math_problems import generate
from moerl.data.prompts import PromptRecord
from moerl.rewards.math import MathReward
from moerl.rewards.worker_pool import PoolClosed

# Checking this takes math-verify (sympy) far longer than any deadline here.
PATHOLOGICAL = "So the answer is \\boxed{9^{9^{9^{9}}}}"
RECORDS = [r for operand in (10, 100, 100_000)
           for r in generate(2 * len(KINDS), 3, "train", {"max_operand": operand})]  # fmt: skip


def kind_of(record: PromptRecord) -> str:
    return record.uid.split("-")[4]


def answer_of(record: PromptRecord) -> Fraction:
    """The spec's LaTeX answer (`7`, `-\\frac{3}{4}`) as a number."""
    text = record.spec["answer"]
    match = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", text)
    if match:
        sign = -1 if match.group(1) else 1
        return sign * Fraction(int(match.group(2)), int(match.group(3)))
    return Fraction(int(text))


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return not stat[stat.rfind(")") + 2:].startswith("Z")


@pytest.fixture(scope="module")
def math_reward() -> Iterator[MathReward]:
    reward = MathReward(workers=2)
    yield reward
    reward.close()


def test_the_records_cover_every_kind() -> None:
    assert {kind_of(r) for r in RECORDS} == set(KINDS)


def test_every_reference_scores_one(math_reward: MathReward) -> None:
    failed = [(r.uid, r.reference, res) for r in RECORDS
              if (res := math_reward.score(r.reference or "", r.spec)).reward != 1.0]
    assert failed == []


def test_references_end_in_the_boxed_answer_and_prompts_ask_for_a_box() -> None:
    for record in RECORDS:
        assert (record.reference or "").endswith(f"\\boxed{{{record.spec['answer']}}}.")
        assert "\\boxed{}" in record.prompt and record.reward == "math"
        assert len(record.prompt) <= 400


def test_wrong_answers_score_zero(math_reward: MathReward) -> None:
    for record in RECORDS:
        for wrong in (answer_of(record) + 1, answer_of(record) * 2 + Fraction(1, 3)):
            completion = f"After some work, \\boxed{{{latex(wrong)}}}"
            assert math_reward.score(completion, record.spec).reward == 0.0, (record, wrong)


@pytest.mark.parametrize("completion", [
    "The answer is {answer}.",  # right number, no box: the prompt asks for one
    "\\boxed{{}}",
    "\\boxed{{banana}}",
    "asdf }}{{ \\boxed{{ \\frac{{",
    "```python\nprint({answer})\n```",
    "",
])  # fmt: skip
def test_malformed_answers_score_zero(math_reward: MathReward, completion: str) -> None:
    for record in RECORDS[:: len(KINDS) + 1]:
        text = completion.format(answer=record.spec["answer"])
        result = math_reward.score(text, record.spec)
        assert result.reward == 0.0 and result.error_kind is None, (text, result)


def test_a_pathological_answer_times_out_in_a_worker_thread_as_a_wrong_answer() -> None:
    reward = MathReward(timeout_s=1.0, workers=1)
    try:
        spec = {"answer": "1"}
        assert reward.score("\\boxed{1}", spec).reward == 1.0  # the worker is up
        [before] = reward.worker_pids()
        with ThreadPoolExecutor(2) as pool:
            start = time.monotonic()
            result = pool.submit(reward.score, PATHOLOGICAL, spec).result(timeout=30)
            took = time.monotonic() - start
        assert result.reward == 0.0 and result.error_kind is None
        assert result.details["timed_out"] is True and result.status == "timeout"
        assert 1.0 <= took < 1.0 + 3.0
        assert not alive(before)  # killed; a new worker takes the next request
        assert reward.score("\\boxed{1}", spec).reward == 1.0
        assert reward.worker_pids() != [before]
    finally:
        reward.close()


def test_workers_outlive_the_short_lived_threads_that_started_them() -> None:
    reward = MathReward(workers=1)
    try:
        thread = threading.Thread(target=reward.score, args=("\\boxed{2}", {"answer": "2"}))
        thread.start()
        thread.join()
        [pid] = reward.worker_pids()
        time.sleep(0.3)
        assert alive(pid)
        assert reward.score("\\boxed{3}", {"answer": "3"}).reward == 1.0
        assert reward.worker_pids() == [pid]
    finally:
        reward.close()


def test_close_leaves_no_process_and_refuses_more_work() -> None:
    reward = MathReward(workers=2)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda a: reward.score(f"\\boxed{{{a}}}", {"answer": str(a)}),
                                [4, 5, 6, 7]))  # fmt: skip
    assert [r.reward for r in results] == [1.0] * 4
    pids = reward.worker_pids()
    assert pids and all(alive(pid) for pid in pids)
    assert not any("torch" in Path(f"/proc/{pid}/maps").read_text() for pid in pids)
    reward.close()
    assert reward.worker_pids() == [] and not any(alive(pid) for pid in pids)
    with pytest.raises(PoolClosed):
        reward.score("\\boxed{1}", {"answer": "1"})


def test_workers_die_with_a_killed_owner_even_in_the_middle_of_a_check() -> None:
    """The owner is SIGKILLed while its worker is busy (so it is not reading its stdin,
    whose end would tell it): the kernel's parent-death signal must end it."""
    script = (
        "import os, signal, threading, time\n"
        "from moerl.rewards.math import MathReward\n"
        "reward = MathReward(workers=1, timeout_s=60)\n"
        "assert reward.score('\\\\boxed{1}', {'answer': '1'}).reward == 1.0\n"
        "print(reward.worker_pids()[0], flush=True)\n"
        f"threading.Thread(target=reward.score, args=({PATHOLOGICAL!r}, {{'answer': '1'}}),\n"
        "                 daemon=True).start()\n"
        "time.sleep(0.5)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    owner = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert owner.returncode == -9, owner.stderr
    pid = int(owner.stdout)
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_same_arguments_give_identical_records_and_seeds_differ() -> None:
    assert generate(12, 4, "train", {}) == generate(12, 4, "train", {})
    assert generate(12, 4, "train", {})[:5] == generate(5, 4, "train", {})
    train, other, held_out = (generate(12, 4, "train", {}), generate(12, 5, "train", {}),
                              generate(12, 4, "eval", {}))  # fmt: skip
    assert all(r.uid.startswith("train-") for r in train)
    assert all(r.uid.startswith("eval-") for r in held_out)
    uids = [r.uid for r in train + other + held_out]
    assert len(set(uids)) == len(uids)
    for records in (other, held_out):
        assert all(a.prompt != b.prompt for a, b in zip(train, records, strict=True))


def test_options_choose_kinds_and_bound_operands() -> None:
    records = generate(8, 1, "eval", {"kinds": ["linear_system", "fractions"], "max_operand": 20})
    assert {kind_of(r) for r in records} == {"linear_system", "fractions"}
    for record in records:
        if kind_of(record) == "linear_system":  # the unknowns are drawn from 1..max_operand
            assert 1 <= answer_of(record) <= 20


@pytest.mark.parametrize(("options", "field"), [
    ({"kinds": ["calculus"]}, "options.kinds"),
    ({"kinds": []}, "options.kinds"),
    ({"kinds": "fractions"}, "options.kinds"),
    ({"max_operand": 5}, "options.max_operand"),
    ({"max_operand": 10**7}, "options.max_operand"),
    ({"max_operand": 50.0}, "options.max_operand"),
    ({"max_operands": 50}, "options.max_operands"),
])  # fmt: skip
def test_bad_options_are_refused_naming_the_field(options: dict[str, object],
                                                  field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field) + ":"):
        generate(2, 0, "train", options)
