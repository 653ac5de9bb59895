"""The `documents` domain: questions about long synthetic annual reports, graded by
exact match.

Each prompt is the report of a fictional company, pages marked "--- Page N ---",
with narrative (overview, management discussion, risks, outlook, operations) and
tables (revenue per segment by half year, operating costs, employees, contractors and
capital expenditure per region), then one question whose answer combines figures from
two or more different pages (kinds in `documents_questions`). The model answers inside
<answer>...</answer>.

options (all optional):
    pages           int >= 2, default 3: pages of the report
    words_per_page  int in [20, 5000], default 120: about how many words a page holds,
                    tables included, a word counted as 6 characters; pages holding many
                    tables may run longer
    max_chars       int, default 3000: the whole prompt (report, question, instructions)
                    never exceeds it; a setting that cannot hold the requested pages is
                    refused (see `chars_needed`)
    kinds           list of question kinds, default all of KINDS

Records: reward "exact_match"; spec {"answer": str, "aliases": [str], "tag": "answer",
"kind": str, "pages": [int] (the distinct pages the answer needs, ascending),
"figures": [{"page", "table" (its title line, null for a sentence), "row", "column",
"value" (as printed), "context" (the clause holding a sentence's value, else null)}]};
reference: one sentence deriving the answer, then <answer>ANSWER</answer>.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from moerl.data.domains.documents_company import (
    BLOCKS,
    make_company,
    make_layout,
    render_block,
    widest_company,
)
from moerl.data.domains.documents_questions import (
    KINDS,
    Question,
    make_question,
    question_max_chars,
)
from moerl.data.domains.documents_render import heading_max_chars, page_marker, render_pages
from moerl.data.prompts import PromptRecord

CHARS_PER_WORD = 6
SPLITS = ("train", "eval")
INTRODUCTION = "Read the annual report below and answer the question after it."
INSTRUCTIONS = ("Write one short sentence that derives the answer, then the answer alone "
                "inside <answer></answer>: a number without units or thousands separators, "
                "or a name.")
_MAX_ATTEMPTS = 200  # companies drawn per record before giving up (a fit comes in a few)


@dataclass(frozen=True)
class DocumentOptions:
    pages: int = 3
    words_per_page: int = 120
    max_chars: int = 3000
    kinds: tuple[str, ...] = KINDS


def _integer(options: Mapping[str, Any], name: str, default: int, low: int, high: int,
             why: str = "") -> int:
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"options.{name}: must be an integer from {low} to {high}{why}, got "
                         f"{value!r}; set it within that range or leave it out for the "
                         f"default ({default})")
    return value


def parse_options(options: Mapping[str, Any]) -> DocumentOptions:
    """The checked options; ValueError naming `options.<field>` and the fix otherwise."""
    known = DocumentOptions.__dataclass_fields__
    for key in options:
        if key not in known:
            raise ValueError(f"options.{key}: not an option of the documents domain; "
                             f"use one of {sorted(known)}")
    default = DocumentOptions()
    pages = _integer(options, "pages", default.pages, 2, 100,
                     " (every answer combines two pages)")
    words = _integer(options, "words_per_page", default.words_per_page, 20, 5000)
    max_chars = _integer(options, "max_chars", default.max_chars, 1, 10**7)
    kinds = options.get("kinds", list(KINDS))
    if (not isinstance(kinds, list | tuple) or not kinds
            or any(k not in KINDS for k in kinds)):
        raise ValueError(f"options.kinds: must be a non-empty list of question kinds out "
                         f"of {list(KINDS)}, got {kinds!r}; pick from those or leave it "
                         "out for all")
    parsed = DocumentOptions(pages, words, max_chars, tuple(dict.fromkeys(kinds)))
    needed = chars_needed(pages, words)
    if needed > max_chars:
        raise ValueError(
            f"options.max_chars: {max_chars} characters cannot hold {pages} pages of about "
            f"{words} words, their tables and the question ({needed} needed); raise "
            f"options.max_chars to {needed} or more, or lower options.pages or "
            f"options.words_per_page")
    return parsed


def _frame(question: str) -> tuple[str, str]:
    """The text before and after the report."""
    return INTRODUCTION + "\n\n", f"\n\nQuestion: {question}\n{INSTRUCTIONS}"


def chars_needed(pages: int, words_per_page: int) -> int:
    """The smallest `max_chars` that holds `pages` pages of about `words_per_page` words,
    and in any case every table, with the longest possible question."""
    widest = widest_company()
    head, tail = _frame("x" * question_max_chars())
    markers = sum(len(page_marker(n)) + 2 for n in range(1, pages + 1)) + 2 * (pages - 1)
    headings = pages * (heading_max_chars(widest) + 2)
    blocks = sum(len(render_block(widest, b)) + 2 for b in BLOCKS)
    return len(head) + len(tail) + markers + max(pages * words_per_page * CHARS_PER_WORD,
                                                 headings + blocks)


def _record(index: int, seed: int, split: str, opts: DocumentOptions) -> PromptRecord:
    rng = random.Random(f"documents:{split}:{seed}:{index}")
    kind = opts.kinds[(seed + index) % len(opts.kinds)]
    for _ in range(_MAX_ATTEMPTS):
        company = make_company(rng)
        layout = make_layout(opts.pages, rng)
        question: Question | None = make_question(kind, company, layout, rng)
        if question is not None:
            break
    else:
        raise RuntimeError(f"no {kind!r} question fits {_MAX_ATTEMPTS} drawn companies")
    head, tail = _frame(question.text)
    budget = opts.max_chars - len(head) - len(tail)
    pages = render_pages(company, layout, opts.pages, opts.words_per_page * CHARS_PER_WORD,
                         budget, rng)
    prompt = head + "\n\n".join(pages) + tail
    spec = {"answer": question.answer, "aliases": list(question.aliases), "tag": "answer",
            "kind": kind, "pages": question.pages,
            "figures": [asdict(f) for f in question.figures]}
    return PromptRecord(uid=f"{split}-documents-{seed}-{index}", prompt=prompt,
                        reward="exact_match", spec=spec,
                        reference=f"{question.explanation} <answer>{question.answer}</answer>")


def generate(count: int, seed: int, split: str, options: Mapping[str, Any]) -> list[PromptRecord]:
    """`count` report questions; the same arguments give the same records. See the module
    docstring for the options and the records' spec."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an integer >= 0, got {count!r}")
    opts = parse_options(options)
    return [_record(i, seed, split, opts) for i in range(count)]
