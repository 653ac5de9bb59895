"""The task families of the `programs` domain: stdin/stdout problems whose constants
and variants are drawn from a seeded `random.Random`.

A family is a function `rng -> ProgramTask`. The task states the problem, draws test
inputs (`draw_input(rng, small)`; small ones are the prompt's examples), computes the
expected output of an input (`solve`), and carries a correct reference program per
language ("python", "c").
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ProgramTask:
    family: str
    statement: str
    input_format: str
    output_format: str
    draw_input: Callable[[random.Random, bool], str]
    solve: Callable[[str], str]
    sources: Mapping[str, str]


_NUMBERS_FORMAT = "line 1: N; line 2: N integers separated by spaces."
_PY_READ_NUMBERS = ("import sys\n\ndata = sys.stdin.read().split()\nn = int(data[0])\n"
                    "values = [int(v) for v in data[1:1 + n]]\n")  # fmt: skip


def _numbers(rng: random.Random, small: bool, low: int, high: int, min_count: int = 1) -> str:
    count = rng.randint(min_count, 4 if small else 12)
    return f"{count}\n{' '.join(str(rng.randint(low, high)) for _ in range(count))}\n"


def _values(text: str) -> list[int]:
    data = text.split()
    return [int(v) for v in data[1:1 + int(data[0])]]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 6)))


def aggregate(rng: random.Random) -> ProgramTask:
    op = rng.choice(["sum", "min", "max"])
    bound = rng.choice([9, 99, 999])
    folds: dict[str, Callable[[list[int]], int]] = {"sum": sum, "min": min, "max": max}
    fold = folds[op]
    what = {"sum": "their sum", "min": "the smallest of them", "max": "the largest of them"}[op]
    update = {"sum": "result += x;", "min": "if (i == 0 || x < result) result = x;",
              "max": "if (i == 0 || x > result) result = x;"}[op]  # fmt: skip
    c = ("#include <stdio.h>\n\nint main(void) {\n    int n;\n    long long x, result = 0;\n"
         "    scanf(\"%d\", &n);\n    for (int i = 0; i < n; i++) {\n"
         f"        scanf(\"%lld\", &x);\n        {update}\n    }}\n"
         "    printf(\"%lld\\n\", result);\n    return 0;\n}\n")  # fmt: skip
    return ProgramTask(
        "aggregate", f"Read N integers (each from -{bound} to {bound}) and print {what}.",
        _NUMBERS_FORMAT, "one line with the result.",
        lambda r, small: _numbers(r, small, -bound, bound),
        lambda text: f"{fold(_values(text))}\n",
        {"python": _PY_READ_NUMBERS + f"print({op}(values))\n", "c": c},
    )  # fmt: skip


def reverse_words(rng: random.Random) -> ProgramTask:
    order = rng.random() < 0.5
    if order:
        statement = "Print the words of the line in reverse order."
        python = 'print(" ".join(input().split()[::-1]))\n'
        c = ("#include <stdio.h>\n\nint main(void) {\n    char words[64][32];\n"
             "    int n = 0;\n    while (n < 64 && scanf(\"%31s\", words[n]) == 1) n++;\n"
             "    for (int i = n - 1; i >= 0; i--) printf(\"%s%s\", words[i], i ? \" \" : "
             "\"\\n\");\n    return 0;\n}\n")  # fmt: skip
    else:
        statement = "Print each word of the line with its letters reversed, in the same order."
        python = 'print(" ".join(word[::-1] for word in input().split()))\n'
        c = ("#include <stdio.h>\n#include <string.h>\n\nint main(void) {\n"
             "    char word[32];\n    int first = 1;\n"
             "    while (scanf(\"%31s\", word) == 1) {\n"
             "        for (int i = 0, j = (int)strlen(word) - 1; i < j; i++, j--) {\n"
             "            char t = word[i];\n            word[i] = word[j];\n"
             "            word[j] = t;\n        }\n"
             "        printf(first ? \"%s\" : \" %s\", word);\n        first = 0;\n    }\n"
             "    printf(\"\\n\");\n    return 0;\n}\n")  # fmt: skip

    def solve(text: str) -> str:
        words = text.split()
        return " ".join(words[::-1] if order else [w[::-1] for w in words]) + "\n"

    return ProgramTask(
        "reverse_words", statement,
        "one line of 1 to 12 lowercase words separated by single spaces.",
        "one line, words separated by single spaces.",
        lambda r, small: " ".join(_word(r) for _ in range(r.randint(2 if small else 1,
                                                                     3 if small else 12))) + "\n",
        solve, {"python": python, "c": c},
    )  # fmt: skip


def count_word(rng: random.Random) -> ProgramTask:
    vocabulary = [_word(rng) for _ in range(4)]

    def draw(r: random.Random, small: bool) -> str:
        target = r.choice(vocabulary) if r.random() < 0.85 else _word(r)
        line = [r.choice(vocabulary) for _ in range(r.randint(1, 5 if small else 12))]
        return f"{target}\n{' '.join(line)}\n"

    def solve(text: str) -> str:
        words = text.split()
        return f"{words[1:].count(words[0])}\n"

    c = ("#include <stdio.h>\n#include <string.h>\n\nint main(void) {\n"
         "    char target[32], word[32];\n    int count = 0;\n    scanf(\"%31s\", target);\n"
         "    while (scanf(\"%31s\", word) == 1)\n"
         "        if (strcmp(word, target) == 0) count++;\n"
         "    printf(\"%d\\n\", count);\n    return 0;\n}\n")  # fmt: skip
    python = "import sys\n\nwords = sys.stdin.read().split()\nprint(words[1:].count(words[0]))\n"
    return ProgramTask(
        "count_word", "Count how many words of the second line are equal to the word W.",
        "line 1: the word W; line 2: lowercase words separated by spaces.",
        "one line with the count.", draw, solve, {"python": python, "c": c},
    )  # fmt: skip


def running_totals(rng: random.Random) -> ProgramTask:
    kind = rng.choice(["sum", "max"])
    what = "sums" if kind == "sum" else "maxima"
    combine = "acc + x" if kind == "sum" else "(x > acc ? x : acc)"
    python_step = "out[-1] + v" if kind == "sum" else "max(out[-1], v)"
    c = ("#include <stdio.h>\n\nint main(void) {\n    int n;\n    long long x, acc = 0;\n"
         "    scanf(\"%d\", &n);\n    for (int i = 0; i < n; i++) {\n"
         f"        scanf(\"%lld\", &x);\n        acc = i == 0 ? x : {combine};\n"
         "        printf(i ? \" %lld\" : \"%lld\", acc);\n    }\n"
         "    printf(\"\\n\");\n    return 0;\n}\n")  # fmt: skip
    python = (_PY_READ_NUMBERS + "out: list[int] = []\nfor i, v in enumerate(values):\n"
              f"    out.append(v if i == 0 else {python_step})\n"
              "print(\" \".join(map(str, out)))\n")  # fmt: skip

    def solve(text: str) -> str:
        out: list[int] = []
        for v in _values(text):
            out.append(v if not out else out[-1] + v if kind == "sum" else max(out[-1], v))
        return " ".join(map(str, out)) + "\n"

    return ProgramTask(
        "running_totals",
        f"Read N integers and print their running {what}: the k-th number printed is the "
        f"{'sum' if kind == 'sum' else 'maximum'} of the first k integers.",
        _NUMBERS_FORMAT, "one line of N integers separated by spaces.",
        lambda r, small: _numbers(r, small, -50, 50), solve, {"python": python, "c": c},
    )  # fmt: skip


def fizzbuzz(rng: random.Random) -> ProgramTask:
    a, b = rng.sample(range(2, 8), 2)
    first, second = rng.sample(["Fizz", "Buzz", "Ping", "Pong", "Zap", "Bop", "Tik", "Tok"], 2)

    def solve(text: str) -> str:
        lines = []
        for i in range(1, int(text) + 1):
            word = (first if i % a == 0 else "") + (second if i % b == 0 else "")
            lines.append(word or str(i))
        return "\n".join(lines) + "\n"

    python = ("n = int(input())\nfor i in range(1, n + 1):\n    word = \"\"\n"
              f"    if i % {a} == 0:\n        word += \"{first}\"\n"
              f"    if i % {b} == 0:\n        word += \"{second}\"\n"
              "    print(word or i)\n")  # fmt: skip
    c = ("#include <stdio.h>\n\nint main(void) {\n    int n;\n    scanf(\"%d\", &n);\n"
         "    for (int i = 1; i <= n; i++) {\n"
         f"        if (i % {a} == 0 && i % {b} == 0) printf(\"{first}{second}\\n\");\n"
         f"        else if (i % {a} == 0) printf(\"{first}\\n\");\n"
         f"        else if (i % {b} == 0) printf(\"{second}\\n\");\n"
         "        else printf(\"%d\\n\", i);\n    }\n    return 0;\n}\n")  # fmt: skip
    return ProgramTask(
        "fizzbuzz",
        f"For each i from 1 to n print one line: {first}{second} if i is divisible by both "
        f"{a} and {b}, {first} if only by {a}, {second} if only by {b}, else i.",
        "one integer n (1 <= n <= 100).", "n lines.",
        lambda r, small: f"{r.randint(3, 8) if small else r.randint(1, 100)}\n",
        solve, {"python": python, "c": c},
    )  # fmt: skip


def gcd_pairs(rng: random.Random) -> ProgramTask:
    lcm = rng.random() < 0.5
    name = "least common multiple" if lcm else "greatest common divisor"
    python_value = "a * b // math.gcd(a, b)" if lcm else "math.gcd(a, b)"
    c_value = "a / gcd(a, b) * b" if lcm else "gcd(a, b)"

    def draw(r: random.Random, small: bool) -> str:
        pairs = []
        for _ in range(r.randint(1, 2 if small else 6)):
            g = r.randint(1, 30)
            pairs.append(f"{g * r.randint(1, 300)} {g * r.randint(1, 300)}")
        return f"{len(pairs)}\n" + "\n".join(pairs) + "\n"

    def solve(text: str) -> str:
        data = [int(v) for v in text.split()]
        pairs = [(data[1 + 2 * k], data[2 + 2 * k]) for k in range(data[0])]
        return "".join(f"{a * b // math.gcd(a, b) if lcm else math.gcd(a, b)}\n"
                       for a, b in pairs)  # fmt: skip

    python = ("import math\nimport sys\n\ndata = sys.stdin.read().split()\n"
              "for k in range(int(data[0])):\n"
              "    a, b = int(data[1 + 2 * k]), int(data[2 + 2 * k])\n"
              f"    print({python_value})\n")  # fmt: skip
    c = ("#include <stdio.h>\n\nlong long gcd(long long a, long long b) {\n"
         "    while (b) {\n        long long r = a % b;\n        a = b;\n        b = r;\n"
         "    }\n    return a;\n}\n\nint main(void) {\n    int t;\n    long long a, b;\n"
         "    scanf(\"%d\", &t);\n    while (t-- > 0) {\n"
         "        scanf(\"%lld %lld\", &a, &b);\n"
         f"        printf(\"%lld\\n\", {c_value});\n    }}\n    return 0;\n}}\n")  # fmt: skip
    return ProgramTask(
        "gcd_pairs", f"For each pair of positive integers print their {name}.",
        "line 1: T; then T lines, each with two integers a and b (1 <= a, b <= 10000).",
        "T lines, one result per pair.", draw, solve, {"python": python, "c": c},
    )  # fmt: skip


def sort_dedupe(rng: random.Random) -> ProgramTask:
    descending = rng.random() < 0.5
    order = "descending" if descending else "ascending"
    compare = "(x < y) - (x > y)" if descending else "(x > y) - (x < y)"
    c = ("#include <stdio.h>\n#include <stdlib.h>\n\n"
         "static int compare(const void *a, const void *b) {\n"
         "    int x = *(const int *)a, y = *(const int *)b;\n"
         f"    return {compare};\n}}\n\nint main(void) {{\n    int n, values[1000];\n"
         "    scanf(\"%d\", &n);\n    for (int i = 0; i < n; i++) scanf(\"%d\", &values[i]);\n"
         "    qsort(values, n, sizeof values[0], compare);\n"
         "    for (int i = 0; i < n; i++)\n"
         "        if (i == 0 || values[i] != values[i - 1]) "
         "printf(i ? \" %d\" : \"%d\", values[i]);\n"
         "    printf(\"\\n\");\n    return 0;\n}\n")  # fmt: skip
    python = (_PY_READ_NUMBERS + f"distinct = sorted(set(values), reverse={descending})\n"
              "print(\" \".join(map(str, distinct)))\n")  # fmt: skip
    return ProgramTask(
        "sort_dedupe", f"Read N integers and print each distinct value once, in {order} order.",
        _NUMBERS_FORMAT, "one line of integers separated by spaces.",
        lambda r, small: _numbers(r, small, 0, 15),
        lambda text: " ".join(map(str, sorted(set(_values(text)), reverse=descending))) + "\n",
        {"python": python, "c": c},
    )  # fmt: skip


def count_matching(rng: random.Random) -> ProgramTask:
    matches: Callable[[int], bool]
    if rng.random() < 0.5:
        threshold = rng.randint(-10, 40)
        what, test = f"greater than {threshold}", f"x > {threshold}"
        matches = lambda x: x > threshold  # noqa: E731
    else:
        divisor = rng.randint(2, 9)
        what, test = f"divisible by {divisor}", f"x % {divisor} == 0"
        matches = lambda x: x % divisor == 0  # noqa: E731
    c = ("#include <stdio.h>\n\nint main(void) {\n    int n, count = 0;\n    long long x;\n"
         "    scanf(\"%d\", &n);\n    for (int i = 0; i < n; i++) {\n"
         f"        scanf(\"%lld\", &x);\n        if ({test}) count++;\n    }}\n"
         "    printf(\"%d\\n\", count);\n    return 0;\n}\n")  # fmt: skip
    python = _PY_READ_NUMBERS + f"print(sum(1 for x in values if {test}))\n"
    return ProgramTask(
        "count_matching", f"Read N integers and print how many of them are {what}.",
        _NUMBERS_FORMAT, "one line with the count.",
        lambda r, small: _numbers(r, small, -50, 100),
        lambda text: f"{sum(1 for x in _values(text) if matches(x))}\n",
        {"python": python, "c": c},
    )  # fmt: skip


FAMILIES: dict[str, Callable[[random.Random], ProgramTask]] = {
    f.__name__: f
    for f in (aggregate, reverse_words, count_word, running_totals, fizzbuzz, gcd_pairs,
              sort_dedupe, count_matching)
}  # fmt: skip
