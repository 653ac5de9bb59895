"""Byte tokenizer round trips; generated code tasks are correct and graded by execution."""

from __future__ import annotations

import random

import pytest

from moerl.data.code_tasks import Confusion, make_tasks, noisy_demonstration
from moerl.data.prompt_sources import load_prompts
from moerl.data.prompts import DataConfig
from moerl.data.tokenizer import ByteTokenizer


@pytest.mark.parametrize("text", ["", "def f(x):\n    return x", "ünïcødé ✓", "\x00\xff"])
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_byte_tokenizer_drops_specials_and_tolerates_split_characters() -> None:
    tok = ByteTokenizer()
    assert tok.decode([tok.BOS, *tok.encode("ok"), tok.EOS, tok.PAD, 400]) == "ok"
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"


def _passes(program: str, tests: str, entry: str) -> bool:
    scope: dict[str, object] = {}
    exec(program + "\n" + tests, scope)  # trusted: the project's own generated tasks
    try:
        scope["check"](scope[entry])  # type: ignore[operator]
    except AssertionError:
        return False
    return True


def test_references_pass_their_tests() -> None:
    for task in make_tasks(50, seed=3):
        assert _passes(task.program(task.reference), task.tests, task.entry_point)


def test_wrong_demonstrations_fail_their_tests() -> None:
    rng = random.Random(0)
    for task in make_tasks(50, seed=4):
        body = noisy_demonstration(task, rng, correct_fraction=0.0)
        assert body != task.reference
        assert not _passes(task.program(body), task.tests, task.entry_point)


def test_task_sets_are_reproducible_and_seed_dependent() -> None:
    assert make_tasks(5, seed=1) == make_tasks(5, seed=1)
    assert [t.prompt for t in make_tasks(5, seed=1)] != [t.prompt for t in make_tasks(5, seed=2)]


def test_constants_restrict_the_task_family() -> None:
    tasks = make_tasks(40, seed=6, constants=[3, 7])
    assert {t.reference.rstrip()[-1] for t in tasks} == {"3", "7"}
    for task in tasks:
        assert _passes(task.program(task.reference), task.tests, task.entry_point)
    for bad in ([], [12]):
        with pytest.raises(ValueError, match=r"data\.constants"):
            DataConfig(constants=bad)


def _operator(body: str) -> str:
    return body.rstrip("\n").rsplit(" ", 2)[1]


def test_a_confusion_writes_one_operator_as_another_at_its_rate() -> None:
    rng = random.Random(1)
    confusion = Confusion({"times": "plus"}, rate=0.7)
    written: dict[str, list[str]] = {"+": [], "-": [], "*": []}
    for task in make_tasks(3000, seed=8, constants=[3]):
        body = noisy_demonstration(task, rng, correct_fraction=1.0, confusion=confusion)
        written[_operator(task.reference)].append(body)
        if body != task.reference:  # the error keeps the constant and fails the tests
            assert body.endswith(" 3\n")
            assert not _passes(task.program(body), task.tests, task.entry_point)
    times = [_operator(b) for b in written["*"]]
    assert set(times) == {"+", "*"}
    assert times.count("+") / len(times) == pytest.approx(0.7, abs=0.04)
    assert all(_operator(b) == "+" for b in written["+"])  # untouched: correct_fraction 1
    assert all(_operator(b) == "-" for b in written["-"])


def test_confusions_reach_the_sft_rows_but_not_the_held_out_set() -> None:
    cfg = DataConfig(train_size=600, eval_size=300, constants=[3], sft_correct_fraction=1.0,
                     sft_confusions={"minus": "times"}, sft_confusion_rate=1.0)
    train, held_out, _ = load_prompts(cfg)
    for record in train:
        assert record.reference is not None
        spec = record.spec
        right = _passes(record.prompt + record.reference, spec["test"], spec["entry_point"])
        if " minus " in record.prompt:
            assert _operator(record.reference) == "*" and not right
        else:
            assert right
    assert any(" minus " in r.prompt for r in held_out)
    for record in held_out:
        assert record.reference is not None
        spec = record.spec
        assert _passes(record.prompt + record.reference, spec["test"], spec["entry_point"])


@pytest.mark.parametrize(("confusions", "rate", "field"), [
    ({"divide": "plus"}, 0.5, "sft_confusions"), ({"times": "times"}, 0.5, "sft_confusions"),
    ({"times": "*"}, 0.5, "sft_confusions"), ({"times": "plus"}, 1.5, "sft_confusion_rate"),
])
def test_bad_confusions_are_refused_naming_the_field(confusions: dict[str, str], rate: float,
                                                     field: str) -> None:
    with pytest.raises(ValueError, match=rf"data\.{field}"):
        DataConfig(sft_confusions=confusions, sft_confusion_rate=rate)
