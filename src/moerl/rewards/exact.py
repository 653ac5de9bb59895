"""Exact-match reward: the last <answer>...</answer> of a completion equals the gold answer
after normalisation (case, whitespace, separators, currency, numbers as numbers).

Normalisation of both sides, in order:
  1. Unicode compatibility forms folded (NFKC), the minus sign U+2212 read as "-", case
     folded, whitespace runs collapsed to one space, surrounding whitespace dropped.
  2. Trailing periods dropped ("1200." -> "1200").
  3. Currency symbols ($ € £ ¥ ₹) dropped anywhere, and the words "usd", "eur", "gbp",
     "dollar", "dollars" dropped where they stand alone ("USD 1,200" -> "1,200").
  4. A value that then reads as a number, optionally with a trailing "%", compares as a
     number: thousands separators (commas in groups of three) dropped, trailing zeros of
     the fraction ignored ("1,200.0" == "1200"). The "%" is optional on both sides: the
     question fixes the unit, so "12.5%", "12.5 %" and "12.5" all match a gold "12.5%"
     (and a gold "12.5"); "0.125" does not.
Anything else compares as the normalised text.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from moerl.rewards.protocol import InvalidSpec, RewardResult

_TAG = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")

MAX_SCANNED_CHARS = 1 << 17
"""Only this many characters at the end of a completion are searched for the tag."""
MAX_ANSWER_CHARS = 2000
"""A tagged answer longer than this is not compared (reward 0.0)."""
_SHOWN_CHARS = 120  # how much of each string the details show

_CURRENCY_SYMBOLS = str.maketrans("", "", "$€£¥₹")
_CURRENCY_WORDS = frozenset({"usd", "eur", "gbp", "dollar", "dollars"})
# One comma-grouped or plain integer part, an optional fraction: no nested repetition,
# so matching is linear (and the input is capped anyway).
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+|(?=\.\d))(?:\.\d+)?")


def normalise(text: str) -> str:
    """`text` in the comparable form described in the module docstring: a number as its
    canonical decimal string ("1200", "12.5", "-3"), anything else as folded text."""
    folded = unicodedata.normalize("NFKC", text).replace("\u2212", "-").casefold()
    folded = " ".join(folded.split()).rstrip(".").strip()
    words = folded.translate(_CURRENCY_SYMBOLS).split()
    cleaned = " ".join(w for w in words if w not in _CURRENCY_WORDS)
    number = _as_number(cleaned)
    return number if number is not None else cleaned


def _as_number(text: str) -> str | None:
    """The canonical decimal string of `text` if it is one number (an optional trailing
    "%" allowed), else None."""
    body = text.removesuffix("%").rstrip()
    if not _NUMBER.fullmatch(body):
        return None
    try:
        value = Decimal(body.replace(",", ""))
    except InvalidOperation:
        return None
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


def last_tagged(completion: str, tag: str) -> str | None:
    """The content of the last complete <tag>...</tag> within the last MAX_SCANNED_CHARS
    characters of `completion`, or None. "Complete" means an opening tag followed by a
    closing one; the content runs from the last opening tag that has a closing tag after
    it to the first closing tag after that opening tag, so in "<a><a>5</a></a>" it is
    "5" and in "<a>1</a><a>2" it is "1"."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    tail = completion[-MAX_SCANNED_CHARS:]
    last_close = tail.rfind(closing)
    if last_close < 0:
        return None
    start = tail.rfind(opening, 0, last_close)
    if start < 0:
        return None
    start += len(opening)
    return tail[start:tail.find(closing, start)]


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _gold_answers(spec: Mapping[str, Any]) -> list[str]:
    answer = spec.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        raise InvalidSpec("spec['answer'] must be a non-empty string")
    aliases = spec.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise InvalidSpec(f"spec['aliases'] must be a list of strings, got {aliases!r}")
    return [answer, *aliases]


class ExactMatchReward:
    """spec: {"answer": str, "aliases"?: list[str], "tag"?: str = "answer"}; other keys
    are ignored. Reward 1.0 when the completion's last complete <tag>...</tag> (see
    `last_tagged`) normalises (see `normalise`) to the normalised answer or an alias,
    else 0.0 (also without a tag, or with an empty or overlong one).

    details: {"extracted": the tag's content or null, "normalised": its normalised form,
    "expected": the normalised answer, "matched": the matching gold string or null},
    strings cut to 120 characters."""

    name = "exact_match"

    def __init__(self, sandbox: object | None = None) -> None:
        pass

    def score(self, completion: str, spec: Mapping[str, Any]) -> RewardResult:
        golds = _gold_answers(spec)
        tag = spec.get("tag", "answer")
        if not isinstance(tag, str) or not _TAG.match(tag):
            raise InvalidSpec(f"spec['tag'] must be a plain tag name, got {tag!r}")
        expected = normalise(golds[0])
        if not expected:
            raise InvalidSpec(f"spec['answer'] {golds[0]!r} is empty once normalised")
        extracted = last_tagged(completion, tag)
        details: dict[str, Any] = {"extracted": None, "normalised": None,
                                   "expected": _short(expected), "matched": None}
        if extracted is None:
            return RewardResult(reward=0.0, details=details)
        details["extracted"] = _short(extracted)
        if len(extracted) > MAX_ANSWER_CHARS:
            return RewardResult(reward=0.0, details=details)
        given = normalise(extracted)
        details["normalised"] = _short(given)
        matched = next((g for g in golds if given and normalise(g) == given), None)
        details["matched"] = None if matched is None else _short(matched)
        return RewardResult(reward=0.0 if matched is None else 1.0, details=details)
