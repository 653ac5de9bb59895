"""The two task families of `sft_sample_efficiency.py`, and how an answer is graded.

`copy`: answers copy multi-digit numbers from the prompt. Each task is a
HumanEval-style problem in the demo's format (signature + docstring, a one-line body,
unit tests run in a fresh interpreter), but constants are drawn from 10-9999 and
lists of three numbers from 0-999 (`--max-constant` lowers both), so an answer is
right only if every digit is copied from the docstring:

    def compute(n):
        \"\"\"Return n plus 4817.\"\"\"
        return n + 4817

    def apply():
        \"\"\"Return the list [3, 91, 27] reversed.\"\"\"
        return [27, 91, 3]

Held-out tasks come from another seed and share no prompt text with the training
tasks, so no answer can be recalled rather than copied.

`demo`: the demo's rows (`data.code_tasks`, every demonstration correct), whose
constants are single digits.
"""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass

OPERATORS = {"plus": "+", "minus": "-", "times": "*"}
ARG_NAMES = ("n", "x", "a", "v", "k")
FUNCTION_NAMES = ("f", "g", "h", "calc", "step", "apply", "compute", "value")


@dataclass(frozen=True)
class Task:
    prompt: str  # signature and docstring
    reference: str  # a correct one-line body, newline-terminated
    tests: str  # `def check(candidate): ...`
    entry_point: str

    def passes(self, completion: str, timeout: float = 5.0) -> bool:
        """Whether the first line of `completion` passes the tests, run in a fresh
        isolated interpreter."""
        line = completion.split("\n")[0] + "\n"
        source = f"{self.prompt}{line}\n{self.tests}\ncheck({self.entry_point})\n"
        try:
            done = subprocess.run([sys.executable, "-I", "-c", source], capture_output=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0


def _arithmetic(rng: random.Random, top: int) -> Task:
    word, op = rng.choice(sorted(OPERATORS.items()))
    const = rng.randrange(10, top)
    arg, name = rng.choice(ARG_NAMES), rng.choice(FUNCTION_NAMES)
    prompt = f'def {name}({arg}):\n    """Return {arg} {word} {const}."""\n'
    outputs = {"+": lambda i: i + const, "-": lambda i: i - const, "*": lambda i: i * const}[op]
    asserts = "".join(f"    assert candidate({i}) == {outputs(i)}\n"
                      for i in rng.sample(range(-20, 21), 3))
    return Task(prompt, f"    return {arg} {op} {const}\n", f"def check(candidate):\n{asserts}",
                name)


def _reversed_list(rng: random.Random, top: int) -> Task:
    values = [rng.randrange(min(top, 1000)) for _ in range(3)]
    name = rng.choice(FUNCTION_NAMES)
    answer = values[::-1]
    return Task(f'def {name}():\n    """Return the list {values} reversed."""\n',
                f"    return {answer}\n",
                f"def check(candidate):\n    assert candidate() == {answer}\n", name)


def copy_tasks(count: int, seed: int, top: int = 10_000) -> list[Task]:
    """`count` copying tasks from `seed`: three in four arithmetic (constants from 10 to
    `top` - 1), one in four a list (numbers below min(`top`, 1000))."""
    rng = random.Random(seed)
    return [(_reversed_list if rng.random() < 0.25 else _arithmetic)(rng, top)
            for _ in range(count)]


def demo_tasks(train_size: int, eval_size: int, seed: int) -> tuple[list[Task], list[Task]]:
    """The demo's rows and held-out prompts, every demonstration correct."""
    from moerl.data.prompt_sources import load_prompts
    from moerl.data.prompts import DataConfig, PromptRecord

    def task(record: PromptRecord) -> Task:
        assert record.reference is not None
        return Task(record.prompt, record.reference, record.spec["test"],
                    record.spec["entry_point"])

    data = DataConfig(train_size=train_size, eval_size=eval_size, seed=seed,
                      sft_correct_fraction=1.0)
    train, held_out, _ = load_prompts(data)
    return [task(r) for r in train], [task(r) for r in held_out]


def load_tasks(family: str, train_size: int, eval_size: int, seed: int,
               top: int = 10_000) -> tuple[list[Task], list[Task]]:
    """(training tasks, held-out tasks) of `family` ("copy" or "demo") for `seed`; `top`
    bounds the copy task's numbers."""
    if family == "demo":
        return demo_tasks(train_size, eval_size, seed)
    held = copy_tasks(eval_size, seed + 1_000_003, top)
    seen = {t.prompt for t in held}
    return [t for t in copy_tasks(train_size, seed, top) if t.prompt not in seen], held


def digit_positions(task: Task) -> list[int]:
    """Indices into the reference of its digits: the characters an answer copies."""
    return [i for i, ch in enumerate(task.reference) if ch.isdigit()]
