"""Plug-in contract: every reward loadable by import path satisfies the protocol and
scores a known-good sample 1.0 and a known-bad one below it; bad paths fail clearly."""

from typing import Any

import pytest

from moerl.rewards.protocol import RewardFunction, RewardResult
from moerl.rewards.registry import BUILTIN, RewardLoadError, load_reward
from moerl.sandbox import Sandbox

EXAMPLES: dict[str, tuple[dict[str, Any], str, str]] = {
    "humaneval": (
        {"prompt": "def inc(x):\n", "entry_point": "inc",
         "test": "def check(candidate):\n    assert candidate(1) == 2\n"},
        "    return x + 1\n", "    return x\n",
    ),
    "stdio": (
        {"language": "python", "cases": [{"input": "2\n", "output": "4\n"}]},
        "print(int(input()) * 2)\n", "print(5)\n",
    ),
    "math": ({"answer": "3"}, "\\boxed{3}", "\\boxed{4}"),
    "format": ({"tag": "answer"}, "<answer>3</answer>", "3"),
    "exact_match": ({"answer": "1,200"}, "The total is <answer>1200</answer>.",
                    "<answer>120</answer>"),
    "scene": ({"target": {"objects": {"a": {"kind": "cube", "at": [1, 2, 0], "size": 1,
                                             "material": "red"}}, "groups": {}},
               "max_calls": 8},
              '<calls>[{"call": "create", "args": {"name": "a", "kind": "cube", '
              '"at": [1, 2, 0], "material": "red"}}]</calls>',
              '<calls>[{"call": "create", "args": {"name": "a", "kind": "cube", '
              '"at": [1, 2, 0], "material": "blue"}}]</calls>'),
}  # fmt: skip


@pytest.mark.sandbox
@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_rewards_honour_the_contract(sandbox: Sandbox, name: str) -> None:
    reward = load_reward(BUILTIN[name], sandbox)
    assert isinstance(reward, RewardFunction) and reward.name == name
    spec, good, bad = EXAMPLES[name]
    good_result, bad_result = reward.score(good, spec), reward.score(bad, spec)
    assert isinstance(good_result, RewardResult) and good_result.reward == 1.0
    assert bad_result.reward is not None and bad_result.reward < 1.0
    assert good_result.error_kind is None


class NotAReward:
    def __init__(self, sandbox: object) -> None:
        pass


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("moerl.rewards.code.HumanEvalReward", "must look like"),
        ("moerl.rewards.nope:Reward", "cannot import module"),
        ("moerl.rewards.code:Nope", "has no attribute 'Nope'"),
        ("moerl.rewards.code:HARNESS", "not callable"),
        (f"{__name__}:NotAReward", "lacks `name: str`"),
    ],
)
def test_bad_import_paths_fail_with_a_clear_message(path: str, message: str) -> None:
    with pytest.raises(RewardLoadError, match=message):
        load_reward(path, None)
