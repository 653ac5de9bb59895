"""The problem kinds of the `math` domain: word problems with exact answers.

A kind is a function `(rng, max_operand) -> MathProblem`: the question, the exact
answer (an integer or a reduced fraction, as `Fraction`) and the worked steps that
lead to it. Operands are drawn from 1..max_operand (multipliers and counts from
smaller ranges), so the answers stay exact by construction.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class MathProblem:
    question: str
    answer: Fraction
    steps: str


def latex(value: Fraction) -> str:
    """`7`, `-3`, `\\frac{3}{4}` or `-\\frac{3}{4}`."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def plain(value: Fraction) -> str:
    """`7` or `3/4` (in steps)."""
    return str(value)


def _small(rng: random.Random, max_operand: int) -> int:
    """A multiplier or a count: 2..min(12, max_operand)."""
    return rng.randint(2, max(2, min(12, max_operand)))


def arithmetic(rng: random.Random, m: int) -> MathProblem:
    if rng.random() < 0.5:
        a = rng.randint(2, m)
        b = rng.randint(1, a)
        c, d = _small(rng, m), _small(rng, m)
        answer = a - b + c * d
        return MathProblem(
            f"A library has {a} books. It lends out {b} of them and then buys {c} boxes "
            f"with {d} books in each. How many books does it have now?",
            Fraction(answer),
            f"After lending: {a} - {b} = {a - b}. Bought: {c} * {d} = {c * d}. "
            f"Now: {a - b} + {c * d} = {answer}.")  # fmt: skip
    trays, per_tray = _small(rng, m), rng.randint(2, m)
    total = trays * per_tray
    bag = rng.randint(2, min(12, total))
    bags = rng.randint(1, total // bag)
    eaten = total - bags * bag
    return MathProblem(
        f"A baker makes {trays} trays of {per_tray} cookies and eats {eaten} of them. She "
        f"packs the rest into bags of {bag}. How many bags does she fill?",
        Fraction(bags),
        f"Cookies: {trays} * {per_tray} = {total}. Left: {total} - {eaten} = "
        f"{total - eaten}. Bags: {total - eaten} / {bag} = {bags}.")  # fmt: skip


def percentage(rng: random.Random, m: int) -> MathProblem:
    rate = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 50, 60, 75])
    if rng.random() < 0.5:
        price = rng.randint(2, m)
        answer = Fraction(price * (100 - rate), 100)
        return MathProblem(
            f"A jacket costs {price} dollars. Its price drops by {rate}%. What is the new "
            "price in dollars?", answer,
            f"The new price is {100 - rate}% of {price}: {price} * {100 - rate} / 100 = "
            f"{plain(answer)}.")  # fmt: skip
    unit = 100 // _gcd(rate, 100)
    students = unit * rng.randint(1, max(1, m // unit))
    walkers = students * rate // 100
    return MathProblem(
        f"{rate}% of the {students} students of a school walk to school. How many "
        "students walk?", Fraction(walkers),
        f"{students} * {rate} / 100 = {walkers}.")  # fmt: skip


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _fraction(rng: random.Random, m: int) -> Fraction:
    denominator = _small(rng, m)
    return Fraction(rng.randint(1, denominator - 1), denominator)


def fractions(rng: random.Random, m: int) -> MathProblem:
    x, y = _fraction(rng, m), _fraction(rng, m)
    if rng.random() < 0.4 and x + y < 1:
        left = 1 - x - y
        return MathProblem(
            f"Ann eats {x} of a pizza and Ben eats {y} of it. What fraction of the pizza "
            "is left?", left,
            f"Eaten: {x} + {y} = {x + y}. Left: 1 - {x + y} = {plain(left)}.")  # fmt: skip
    symbol, result = rng.choice([("+", x + y), ("-", x - y), ("*", x * y), ("/", x / y)])
    return MathProblem(
        f"Compute ({x}) {symbol} ({y}). Give the exact answer in lowest terms.", result,
        f"({x}) {symbol} ({y}) = {plain(result)}.")  # fmt: skip


def linear_equation(rng: random.Random, m: int) -> MathProblem:
    a, c = rng.sample(range(1, max(3, min(12, m)) + 1), 2)
    b = rng.randint(-m, m)
    d = b + rng.randint(-m, m)  # (a - c) x = d - b, so x = (d - b) / (a - c)
    x = Fraction(d - b, a - c)
    return MathProblem(
        f"Solve for x: {a}x + {b} = {c}x + {d}.".replace("+ -", "- "), x,
        f"Move the x terms left and the numbers right: ({a} - {c})x = {d} - ({b}), so "
        f"{a - c}x = {d - b} and x = {d - b} / {a - c} = {plain(x)}.")  # fmt: skip


def _items(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def linear_system(rng: random.Random, m: int) -> MathProblem:
    while True:
        a, b, c, d = (rng.randint(1, max(2, min(9, m))) for _ in range(4))
        if a * d - b * c != 0:
            break
    x, y = rng.randint(1, m), rng.randint(1, m)
    e, f = a * x + b * y, c * x + d * y
    det = a * d - b * c
    if rng.random() < 0.5:
        return MathProblem(
            f"{_items(a, 'pen')} and {_items(b, 'pencil')} cost {e} cents; "
            f"{_items(c, 'pen')} and {_items(d, 'pencil')} cost {f} cents. How many cents "
            "does one pen cost?", Fraction(x),
            f"With p and q the prices: p = ({e} * {d} - {b} * {f}) / ({a} * {d} - {b} * {c}) "
            f"= {e * d - b * f} / {det} = {x}.")  # fmt: skip
    return MathProblem(
        f"If {a}x + {b}y = {e} and {c}x + {d}y = {f}, what is y?", Fraction(y),
        f"Eliminate x: y = ({a} * {f} - {c} * {e}) / ({a} * {d} - {b} * {c}) = "
        f"{a * f - c * e} / {det} = {y}.")  # fmt: skip


def average(rng: random.Random, m: int) -> MathProblem:
    values = [rng.randint(1, m) for _ in range(rng.randint(3, 5))]
    listed = ", ".join(map(str, values))
    if rng.random() < 0.5:
        mean = Fraction(sum(values), len(values))
        return MathProblem(
            f"What is the average of {listed}?", mean,
            f"Sum: {sum(values)}. Count: {len(values)}. Average: {sum(values)} / "
            f"{len(values)} = {plain(mean)}.")  # fmt: skip
    known, count = values[:-1], len(values)
    mean = Fraction(sum(values), count)
    if mean.denominator != 1:  # make the stated average whole by adjusting the missing value
        values[-1] += count - sum(values) % count
        mean = Fraction(sum(values), count)
    missing = values[-1]
    return MathProblem(
        f"The average of {count} numbers is {mean}. {count - 1} of them are "
        f"{', '.join(map(str, known))}. What is the remaining number?", Fraction(missing),
        f"Total: {count} * {mean} = {mean * count}. Known: {sum(known)}. Remaining: "
        f"{mean * count} - {sum(known)} = {missing}.")  # fmt: skip


KINDS: dict[str, Callable[[random.Random, int], MathProblem]] = {
    f.__name__: f
    for f in (arithmetic, percentage, fractions, linear_equation, linear_system, average)
}  # fmt: skip
