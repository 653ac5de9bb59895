import pytest

from moerl.rewards.format import FormatReward
from moerl.rewards.math import MathReward
from moerl.rewards.protocol import InvalidSpec


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("So the total is \\boxed{42}.", "42", 1.0),
        ("The answer is \\boxed{41}.", "42", 0.0),
        ("Thus $x = \\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("We get \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("No idea.", "7", 0.0),
    ],
)
def test_math_answers_are_verified(completion: str, answer: str, expected: float) -> None:
    assert MathReward().score(completion, {"answer": answer}).reward == expected


def test_math_rejects_a_missing_gold_answer() -> None:
    with pytest.raises(InvalidSpec):
        MathReward().score("\\boxed{1}", {})


@pytest.mark.parametrize(
    ("completion", "spec", "expected"),
    [
        ("<think>hm</think><answer>42</answer>", {"tag": "answer"}, 1.0),
        ("<answer>42</answer>", {"require_think": True}, 0.0),
        ("<think>a</think> <answer>42</answer>", {"require_think": True}, 1.0),
        ("<answer></answer>", {}, 0.0),
        ("<answer>1</answer><answer>2</answer>", {}, 0.0),
        ("answer: 42", {}, 0.0),
        ("<final>x</final>", {"tag": "final"}, 1.0),
    ],
)
def test_format_reward(completion: str, spec: dict[str, object], expected: float) -> None:
    assert FormatReward().score(completion, spec).reward == expected


def test_format_rejects_odd_tag_names() -> None:
    with pytest.raises(InvalidSpec):
        FormatReward().score("x", {"tag": "a>(.*)<b"})
