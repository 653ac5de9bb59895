"""The `programs` domain: stdin/stdout programming tasks in Python and C, graded by the
`stdio` reward on hidden test cases (moerl.rewards.code.StdioReward).

Tasks come from the families of `program_families.py` (sum/min/max, reversing words,
counting a word, running totals, FizzBuzz-like rules, gcd/lcm of pairs, sorting with
duplicates removed, counting matches), with constants and variants drawn per record.
Record i is written in languages[i % len(languages)] and belongs to the family
(offset + i // len(languages)) mod (number of families), the offset drawn from the
seed; its content depends only on (seed, split, i), so a longer set extends a
shorter one.

Options:
    languages     subset of ["python", "c"] (default both)
    hidden_cases  test cases in the spec, never shown (default 5, 1..64)
    shown_cases   examples in the prompt, none of them among the hidden ones
                  (default 1, 0..3)

The spec is {"language", "cases": [{"input", "output"}]} with the hidden cases; the
reference is a correct program in the record's language.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from moerl.data.domains.generator_args import check_call, int_option, subset_option
from moerl.data.domains.options import check_keys
from moerl.data.domains.program_families import FAMILIES, ProgramTask
from moerl.data.prompts import PromptRecord

LANGUAGES = ("python", "c")
_LANGUAGE_NAMES = {"python": "Python 3", "c": "C (C17, compiled with gcc)"}
_DEFAULTS: dict[str, Any] = {"languages": None, "hidden_cases": 5, "shown_cases": 1}


def _cases(task: ProgramTask, rng: random.Random, shown: int, hidden: int) -> list[dict[str, str]]:
    """`shown` small cases, then `hidden` others, all with distinct inputs."""
    inputs: list[str] = []
    for wanted, small in ((shown, True), (shown + hidden, False)):
        tries = 0
        while len(inputs) < wanted:
            text = task.draw_input(rng, small)
            if text not in inputs:
                inputs.append(text)
            tries += 1
            if tries > 100 * (hidden + shown):
                raise RuntimeError(f"{task.family}: cannot draw {wanted} distinct inputs")
    return [{"input": text, "output": task.solve(text)} for text in inputs]


def prompt_text(task: ProgramTask, language: str, examples: list[dict[str, str]]) -> str:
    """The problem, its input and output format, the examples and the language."""
    parts = [f"Write a complete {_LANGUAGE_NAMES[language]} program that reads standard "
             f"input and writes standard output.\n{task.statement}\n"
             f"Input: {task.input_format}\nOutput: {task.output_format}\n"]  # fmt: skip
    for case in examples:
        parts.append(f"Example input:\n{case['input']}Example output:\n{case['output']}")
    parts.append("Reply with the program only: no Markdown fences, no explanation.")
    return "".join(parts)


def generate(count: int, seed: int, split: str, options: Mapping[str, Any]) -> list[PromptRecord]:
    check_call(count, split)
    opts = check_keys(options, _DEFAULTS)
    languages = subset_option(opts, "languages", LANGUAGES)
    hidden = int_option(opts, "hidden_cases", 1, 64)
    shown = int_option(opts, "shown_cases", 0, 3)
    families = list(FAMILIES)
    offset = random.Random(f"programs/{seed}/{split}").randrange(len(families))
    records = []
    for i in range(count):
        rng = random.Random(f"programs/{seed}/{split}/{i}")
        language = languages[i % len(languages)]
        family = families[(offset + i // len(languages)) % len(families)]
        task = FAMILIES[family](rng)
        cases = _cases(task, rng, shown, hidden)
        records.append(PromptRecord(
            uid=f"{split}-programs-{seed}-{i}-{family}-{language}",
            prompt=prompt_text(task, language, cases[:shown]),
            reward="stdio",
            spec={"language": language, "cases": cases[shown:]},
            reference=task.sources[language],
        ))  # fmt: skip
    return records
