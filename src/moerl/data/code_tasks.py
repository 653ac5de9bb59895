"""A generated code-writing task family for the tiny model's demo and tests.

Each task is a HumanEval-style problem: a prompt (signature + docstring), a
reference body, and a `check(candidate)` function of unit tests that the reward
server runs in the sandbox. The functions are one-line arithmetic on the
argument ("Return n times 3."), small enough that a few-million-parameter model
trained from scratch can learn them on a CPU in minutes, and graded only by
execution.

SFT data is deliberately imperfect: a demonstration is correct with probability
`correct_fraction` and otherwise a plausible wrong program (wrong operator or
constant), the way real demonstration sets are noisy. A demonstrator can also err
systematically (`Confusion`: "times" written as + more often than not), so that the
supervised model's most likely answer is wrong while the right one is still among
its samples. RL on the execution reward then has something to fix.

Held-out tasks (`make_tasks(..., held_out=True)`) are named from their own pool of
function names, none of which a training task uses: every prompt starts
`def <name>(`, so no held-out prompt's text occurs among the training prompts (the
SFT rows and RL prompts) for any seed or size, while the skill a held-out task tests,
reading the operator word and writing it with the argument and the constant, is the
training tasks' own (the same operators, argument names and constants).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

OPERATOR_WORDS = {"plus": "+", "minus": "-", "times": "*"}
_OPS = OPERATOR_WORDS
_ARGS = ("n", "x", "a", "v", "k")
TRAIN_NAMES = ("f", "g", "h", "calc", "step", "apply", "compute", "value",
               "q", "t", "y", "get", "run", "make", "find", "work", "task", "rule", "form",
               "go", "use", "pick", "turn", "walk")
"""Many names, so that a model learns the name is not what decides the body: with the
first eight only, the demo's SFT and RL model failed held-out tasks named `func` or
`answer` that it solved under a training name."""
HELD_OUT_NAMES = ("m", "p", "r", "func", "solve", "result", "answer", "output")
"""Function names of held-out tasks only; like the training names, single letters and
words that suggest no operator."""


@dataclass(frozen=True)
class CodeTask:
    uid: str
    prompt: str  # signature and docstring; the completion is the body
    reference: str  # a correct body
    tests: str  # `def check(candidate): ...` with the expected values inside
    entry_point: str

    def program(self, completion: str) -> str:
        return self.prompt + completion


def _expected(op: str, arg: int, const: int) -> int:
    return {"+": arg + const, "-": arg - const, "*": arg * const}[op]


def make_task(rng: random.Random, uid: str, constants: Sequence[int] | None = None,
              names: Sequence[str] = TRAIN_NAMES) -> CodeTask:
    """One task; its constant from `constants` (digits; None: any of 0-9), its function
    name from `names`."""
    word, op = rng.choice(sorted(_OPS.items()))
    const = rng.randrange(10) if constants is None else rng.choice(constants)
    arg = rng.choice(_ARGS)
    name = rng.choice(names)
    prompt = f'def {name}({arg}):\n    """Return {arg} {word} {const}."""\n'
    reference = f"    return {arg} {op} {const}\n"
    inputs = rng.sample(range(-20, 21), 4)
    asserts = "".join(
        f"    assert candidate({i}) == {_expected(op, i, const)}\n" for i in inputs
    )
    return CodeTask(uid, prompt, reference, f"def check(candidate):\n{asserts}", name)


def make_tasks(count: int, seed: int, prefix: str = "task",
               constants: Sequence[int] | None = None, *,
               held_out: bool = False) -> list[CodeTask]:
    """`count` tasks drawn from `seed`; different seeds give independent sets. With
    `held_out`, named from HELD_OUT_NAMES: prompts no training task has."""
    rng = random.Random(seed)
    names = HELD_OUT_NAMES if held_out else TRAIN_NAMES
    return [make_task(rng, f"{prefix}-{seed}-{i}", constants, names) for i in range(count)]


@dataclass(frozen=True)
class Confusion:
    """A systematic demonstrator error: tasks whose operator is the word `written_as`'s
    key are demonstrated with the operator `written_as[word]` (same constant) with
    probability `rate`, and correctly otherwise."""

    written_as: Mapping[str, str]
    rate: float


def noisy_demonstration(task: CodeTask, rng: random.Random, correct_fraction: float,
                        confusion: Confusion | None = None) -> str:
    """The reference body with probability `correct_fraction`, else a wrong one; tasks
    that `confusion` covers follow its rate instead."""
    # "    return n + 3\n" -> another operator or constant that computes a different
    # function (n + 0, n - 0 and n * 1 are all the identity).
    head, op, const = task.reference.rstrip("\n").rsplit(" ", 2)
    word = next(w for w, o in _OPS.items() if o == op)
    if confusion is not None and word in confusion.written_as:
        if rng.random() < confusion.rate:
            return f"{head} {_OPS[confusion.written_as[word]]} {const}\n"
        return task.reference
    if rng.random() < correct_fraction:
        return task.reference
    wrong = [
        (o, c) for o in _OPS.values() for c in range(10)
        if any(_expected(o, i, c) != _expected(op, i, int(const)) for i in (-3, 7))
    ]
    same_op = [w for w in wrong if w[0] == op]
    new_op, new_const = rng.choice(same_op if same_op and rng.random() < 0.5 else wrong)
    return f"{head} {new_op} {new_const}\n"
