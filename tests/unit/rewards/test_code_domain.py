"""The `code` domain's records through their reward in the real sandbox: references
score 1.0, wrong, malformed and hostile bodies below it."""

from __future__ import annotations

import pytest

from moerl.data.domains.code import generate
from moerl.rewards.code import HumanEvalReward
from moerl.sandbox import Sandbox

pytestmark = pytest.mark.sandbox


def test_references_pass_and_wrong_or_hostile_bodies_do_not(sandbox: Sandbox) -> None:
    reward = HumanEvalReward(sandbox)
    records = generate(6, seed=3, split="train", options={})
    assert {r.reward for r in records} == {"humaneval"}
    for record in records:
        assert reward.score(record.reference or "", record.spec).reward == 1.0
    spec = records[0].spec
    body = records[0].reference or ""
    for bad in ("", "    return (\n", "    return None\n", body.replace("return ", "return 1 + "),
                "    while True:\n        pass\n",
                "    import os\n    os._exit(0)\n"):  # exits before the tests report
        result = reward.score(bad, spec)
        assert result.reward is not None and result.reward < 1.0, (bad, result)


def test_the_domain_options_are_checked() -> None:
    assert {r.prompt.split('"""')[1].split()[-1] for r in generate(
        20, 0, "eval", {"constants": [4]})} == {"4."}
    with pytest.raises(ValueError, match=r"options\.constants"):
        generate(2, 0, "train", {"constants": [12]})
    with pytest.raises(ValueError, match=r"options\.nope: unknown option"):
        generate(2, 0, "train", {"nope": 1})
    assert not {r.uid for r in generate(5, 0, "train", {})} & {
        r.uid for r in generate(5, 0, "eval", {})}
