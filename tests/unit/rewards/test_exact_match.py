import time
from typing import Any

import pytest

from moerl.rewards.exact import MAX_SCANNED_CHARS, ExactMatchReward, normalise
from moerl.rewards.protocol import InvalidSpec, RewardFunction

REWARD = ExactMatchReward()


def _score(completion: str, answer: str, **spec: Any) -> float | None:
    return REWARD.score(completion, {"answer": answer, **spec}).reward


@pytest.mark.parametrize(
    ("given", "gold"),
    [
        ("1,200", "1200"),
        ("1,200.0", "1200"),
        ("1200", "1,200.00"),
        ("$1,200", "1200"),
        ("USD 1,200", "1,200"),
        ("1200 usd", "$1200"),
        ("€ 3", "3"),
        ("1,234,567", "1234567"),
        ("7.740", "7.74"),
        ("0.50", ".5"),
        ("+7", "7"),
        ("-0", "0"),
        ("\u22124.5%", "-4.5%"),  # a typographic minus
        ("2690.", "2690"),
        (" Cloud   Services. ", "cloud services"),
        ("DATA\tANALYTICS", "Data Analytics"),
        # The question fixes the unit, so a percent sign is optional on either side.
        ("12.5%", "12.5%"),
        ("12.5 %", "12.5%"),
        ("12.5", "12.5%"),
        ("12.5%", "12.5"),
    ],
)
def test_equal_after_normalisation(given: str, gold: str) -> None:
    assert _score(f"<answer>{given}</answer>", gold) == 1.0


@pytest.mark.parametrize(
    ("given", "gold"),
    [
        ("120", "1200"),
        ("12000", "1200"),
        ("1,2000", "12000"),  # not a thousands grouping: compared as text
        ("1,20", "120"),
        ("12.6%", "12.5%"),
        ("0.125", "12.5%"),  # a fraction is not its percentage
        ("4.5", "-4.5"),
        ("1200 thousand", "1200"),  # only currency words are dropped
        ("1e3", "1000"),
        ("Cloud", "Cloud Services"),
        ("Cloud Services Inc", "Cloud Services"),
    ],
)
def test_different_after_normalisation(given: str, gold: str) -> None:
    assert _score(f"<answer>{given}</answer>", gold) == 0.0


def test_normal_forms() -> None:
    assert normalise("$1,200.50 USD") == "1200.5"
    assert normalise("  -0.0 ") == "0"
    assert normalise("The  North America region.") == "the north america region"


def test_aliases_match_too() -> None:
    spec = {"answer": "Data Analytics", "aliases": ["the Data Analytics segment"]}
    assert REWARD.score("<answer>The data analytics segment</answer>", spec).reward == 1.0
    assert REWARD.score("<answer>Data Analytics segment</answer>", spec).reward == 0.0


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("<answer>1</answer> on second thought <answer>2</answer>", "2", 1.0),
        ("<answer>1</answer> on second thought <answer>2</answer>", "1", 0.0),
        ("<answer>1</answer> then <answer>2", "1", 1.0),  # the last complete one counts
        ("<answer><answer>5</answer></answer>", "5", 1.0),
        ("<answer>3</answer></answer>", "3", 1.0),
        ("<answer>5</Answer>", "5", 0.0),  # tag names are case-sensitive
        ("<answer>5", "5", 0.0),
        ("5</answer>", "5", 0.0),
        ("</answer>5<answer>", "5", 0.0),
        ("The answer is 5.", "5", 0.0),
        ("<answer></answer>", "5", 0.0),
        ("<answer>  </answer>", "5", 0.0),
        ("<answer>$</answer>", "5", 0.0),
    ],
)
def test_the_last_complete_tag_is_graded(completion: str, gold: str, expected: float) -> None:
    assert _score(completion, gold) == expected


def test_another_tag_name() -> None:
    assert _score("<final>42</final> <answer>1</answer>", "42", tag="final") == 1.0
    assert _score("<answer>42</answer>", "42", tag="final") == 0.0


def test_details_show_the_extracted_and_normalised_answer() -> None:
    result = REWARD.score("work... <answer> $1,200.0 </answer>", {"answer": "1200"})
    assert result.details == {"extracted": " $1,200.0 ", "normalised": "1200",
                              "expected": "1200", "matched": "1200"}
    missing = REWARD.score("no tag", {"answer": "1200"})
    assert missing.reward == 0.0 and missing.details["extracted"] is None
    long = REWARD.score("<answer>" + "x" * 500 + "</answer>", {"answer": "1"})
    assert isinstance(long.details["extracted"], str)
    assert len(long.details["extracted"]) < 130 and long.details["matched"] is None


@pytest.mark.parametrize(
    "completion",
    [
        "x" * 5_000_000,
        "<answer>" * 400_000,
        "</answer>" * 400_000,
        "<answer>1</answer>" * 200_000,
        "<answer>" + "1," * 1_000_000 + "</answer>",
        "<answer>" + "9" * 100_000 + "</answer>",
        "<answer>" + "1,000" * 399 + "</answer>",
    ],
    ids=["plain", "openings", "closings", "many-tags", "huge-tag", "long-tag", "comma-run"],
)
def test_hostile_completions_are_graded_quickly(completion: str) -> None:
    start = time.perf_counter()
    result = REWARD.score(completion, {"answer": "1"})
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5
    assert result.reward == (1.0 if completion.startswith("<answer>1</answer>") else 0.0)


def test_only_the_end_of_a_completion_is_searched() -> None:
    early = "<answer>7</answer>" + " " * MAX_SCANNED_CHARS
    assert _score(early, "7") == 0.0
    assert _score(early[:-100], "7") == 1.0


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"answer": 5},
        {"answer": "   "},
        {"answer": "$"},
        {"answer": "1", "aliases": "1"},
        {"answer": "1", "aliases": [1]},
        {"answer": "1", "tag": "a>(.*)<b"},
        {"answer": "1", "tag": 3},
    ],
)
def test_malformed_specs_are_invalid(spec: dict[str, Any]) -> None:
    with pytest.raises(InvalidSpec):
        REWARD.score("<answer>1</answer>", spec)


def test_satisfies_the_reward_protocol() -> None:
    reward = ExactMatchReward(None)
    assert isinstance(reward, RewardFunction)
    assert reward.name == "exact_match"
