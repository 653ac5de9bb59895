import re
import subprocess
import sys
from collections import defaultdict
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest

from moerl.data.domains.documents import chars_needed, generate
from moerl.data.domains.documents_questions import KINDS, rounded
from moerl.data.prompts import PromptRecord
from moerl.rewards.exact import ExactMatchReward

REWARD = ExactMatchReward()
_MARKER = re.compile(r"^--- Page (\d+) ---$", re.MULTILINE)


def _pages(prompt: str) -> dict[int, str]:
    """page number -> the text below its marker (up to the next marker or the question)."""
    body = prompt.split("\n\nQuestion: ")[0]
    parts = _MARKER.split(body)
    return {int(number): text for number, text in zip(parts[1::2], parts[2::2], strict=True)}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _printed(page: str, fig: dict[str, Any]) -> str:
    """The value that `page` prints where `fig` says its figure stands."""
    if fig["table"] is None:
        assert fig["context"] in page
        return str(fig["context"]).split(" in ")[0]
    lines = page.splitlines()
    start = lines.index(fig["table"])
    header = _cells(lines[start + 1])
    rows = [_cells(line) for line in lines[start + 2:] if line.startswith("|")]
    row = next(r for r in rows if r[0] == fig["row"])
    return row[header.index(fig["column"])]


def _number(printed: str) -> int:
    return int(printed.replace(",", ""))


def _recomputed(kind: str, values: list[int], rows: list[str], answer: str) -> bool:
    """Whether `answer` follows from the figures as the question kind says."""
    if kind == "sum":
        return int(answer) == sum(values)
    if kind == "difference":
        return int(answer) == values[0] - values[1]
    if kind == "growth":
        return answer == rounded(Fraction(values[1] - values[0], values[0]) * 100, 1) + "%"
    if kind == "ratio":
        return answer == rounded(Fraction(values[0], values[1]), 2)
    totals: dict[str, int] = defaultdict(int)
    for row, value in zip(rows, values, strict=True):
        totals[row] += value
    best = max(totals.values())
    return [r for r, t in totals.items() if t == best] == [answer]


def _wrong(answer: str) -> str:
    if answer.endswith("%") or re.fullmatch(r"-?[\d.]+", answer):
        number = Decimal(answer.rstrip("%")) + 1
        return f"<answer>{number}</answer>"
    return "<answer>Nonexistent Segment</answer>"


def test_same_arguments_give_the_same_records() -> None:
    options = {"pages": 3, "kinds": ["growth", "largest"]}
    assert generate(6, 11, "train", options) == generate(6, 11, "train", options)
    first, other = generate(6, 11, "train", {}), generate(6, 12, "train", {})
    assert all(a.prompt != b.prompt for a, b in zip(first, other, strict=True))


def test_splits_never_share_a_uid() -> None:
    train, held_out = generate(20, 0, "train", {}), generate(20, 0, "eval", {})
    train_uids, eval_uids = {r.uid for r in train}, {r.uid for r in held_out}
    assert len(train_uids) == len(eval_uids) == 20
    assert not train_uids & eval_uids
    assert all(u.startswith("train-") for u in train_uids)
    assert all(u.startswith("eval-") for u in eval_uids)
    assert {r.prompt for r in train}.isdisjoint(r.prompt for r in held_out)


@pytest.mark.parametrize("kind", KINDS)
def test_references_score_one_and_wrong_answers_zero(kind: str) -> None:
    records = generate(16, 5, "train", {"kinds": [kind], "pages": 2})
    for record in records:
        assert record.reward == "exact_match" and record.spec["kind"] == kind
        assert record.reference is not None and record.reference.count("<answer>") == 1
        assert REWARD.score(record.reference, record.spec).reward == 1.0
        assert REWARD.score(_wrong(record.spec["answer"]), record.spec).reward == 0.0
        assert "<answer>" in record.prompt and record.spec["answer"] in record.reference


def _check_figures(record: PromptRecord) -> None:
    pages = _pages(record.prompt)
    figures = record.spec["figures"]
    assert record.spec["pages"] == sorted({f["page"] for f in figures})
    assert len(record.spec["pages"]) >= 2
    for fig in figures:
        assert _printed(pages[fig["page"]], fig) == fig["value"]
        shown_on = [n for n, text in pages.items()
                    if (fig["table"] or fig["context"]) in text]
        assert shown_on == [fig["page"]], "a figure's source is printed on one page only"
    values = [_number(f["value"]) for f in figures]
    rows = [f["row"] for f in figures]
    assert _recomputed(record.spec["kind"], values, rows, record.spec["answer"])


@pytest.mark.parametrize("pages", [2, 3, 4, 7])
def test_answers_follow_from_figures_on_the_named_pages(pages: int) -> None:
    options = {"pages": pages, "max_chars": chars_needed(pages, 120)}
    records = generate(40, pages, "eval", options)
    assert {r.spec["kind"] for r in records} == set(KINDS)
    for record in records:
        _check_figures(record)


@pytest.mark.parametrize(("pages", "words"), [(2, 120), (3, 120), (5, 60), (8, 200), (3, 20)])
def test_prompts_fit_the_smallest_accepted_max_chars(pages: int, words: int) -> None:
    needed = chars_needed(pages, words)
    records = generate(30, 1, "train", {"pages": pages, "words_per_page": words,
                                        "max_chars": needed})
    for record in records:
        assert len(record.prompt) <= needed
        assert sorted(_pages(record.prompt)) == list(range(1, pages + 1))
    with pytest.raises(ValueError, match=r"options\.max_chars.*options\.pages"):
        generate(1, 1, "train", {"pages": pages, "words_per_page": words,
                                 "max_chars": needed - 1})


def test_defaults_fit_three_thousand_characters_and_pages_grow_with_words() -> None:
    records = generate(30, 2, "train", {})
    assert all(len(r.prompt) <= 3000 for r in records)
    assert all(len(_pages(r.prompt)) == 3 for r in records)
    short = generate(10, 2, "train", {"words_per_page": 60})
    long = generate(10, 2, "train", {"words_per_page": 300, "max_chars": 8000})
    assert sum(len(r.prompt) for r in long) > 2 * sum(len(r.prompt) for r in short)


def test_impossible_sizes_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError) as refused:
        generate(1, 0, "train", {"pages": 8})
    message = str(refused.value)
    needed = chars_needed(8, 120)
    assert "options.max_chars" in message and "options.pages" in message
    assert f"raise options.max_chars to {needed}" in message
    with pytest.raises(ValueError, match=r"options\.max_chars"):
        generate(1, 0, "train", {"pages": 2, "words_per_page": 20, "max_chars": 900})


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"pages": 1}, "pages"),
        ({"pages": "3"}, "pages"),
        ({"pages": True}, "pages"),
        ({"words_per_page": 5}, "words_per_page"),
        ({"words_per_page": 120.0}, "words_per_page"),
        ({"max_chars": 0}, "max_chars"),
        ({"kinds": []}, "kinds"),
        ({"kinds": "sum"}, "kinds"),
        ({"kinds": ["sum", "poetry"]}, "kinds"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_option_errors_name_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^options\.{field}: "):
        generate(1, 0, "train", options)


def test_bad_split_and_count_are_refused() -> None:
    with pytest.raises(ValueError, match="split"):
        generate(1, 0, "test", {})
    with pytest.raises(ValueError, match="count"):
        generate(-1, 0, "train", {})
    assert generate(0, 0, "train", {}) == []


def test_generator_and_reward_import_no_torch() -> None:
    code = ("import sys, moerl.data.domains.documents, moerl.rewards.exact; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
