"""The `math` domain: arithmetic and algebra word problems with exact answers (integers
or reduced fractions), graded by the `math` reward (moerl.rewards.math.MathReward).

Kinds (math_kinds.py): arithmetic (multi-step), percentage, fractions,
linear_equation (one unknown), linear_system (two unknowns), average. Record i is of
kind kinds[(offset + i) mod len(kinds)], the offset drawn from the seed; its content
depends only on (seed, split, i).

Options:
    kinds        subset of the kinds above (default all)
    max_operand  the largest operand drawn (default 100, 10..1000000)

The prompt asks for the final answer in \\boxed{}; the spec is {"answer": LaTeX
answer, "require_boxed": true}; the reference is a short worked solution ending in
\\boxed{answer}.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from moerl.data.domains.generator_args import check_call, int_option, subset_option
from moerl.data.domains.math_kinds import KINDS, latex
from moerl.data.domains.options import check_keys
from moerl.data.prompts import PromptRecord

_DEFAULTS: dict[str, Any] = {"kinds": None, "max_operand": 100}
_INSTRUCTION = "Solve the problem. Put the final answer, a number, in \\boxed{}."


def generate(count: int, seed: int, split: str, options: Mapping[str, Any]) -> list[PromptRecord]:
    check_call(count, split)
    opts = check_keys(options, _DEFAULTS)
    kinds = subset_option(opts, "kinds", list(KINDS))
    max_operand = int_option(opts, "max_operand", 10, 1_000_000)
    offset = random.Random(f"math/{seed}/{split}").randrange(len(kinds))
    records = []
    for i in range(count):
        kind = kinds[(offset + i) % len(kinds)]
        problem = KINDS[kind](random.Random(f"math/{seed}/{split}/{i}"), max_operand)
        answer = latex(problem.answer)
        records.append(PromptRecord(
            uid=f"{split}-math-{seed}-{i}-{kind}",
            prompt=f"{problem.question}\n{_INSTRUCTION}",
            reward="math",
            spec={"answer": answer, "require_boxed": True},
            reference=f"{problem.steps}\nThe answer is \\boxed{{{answer}}}.",
        ))  # fmt: skip
    return records
