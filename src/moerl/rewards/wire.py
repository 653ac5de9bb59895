"""What travels through the reward and environment servers, made safe value by value.

JSON can carry text that is not valid Unicode: a lone surrogate (`"\\udc80"`, which a
byte-level decode with `surrogateescape` makes of bytes that are not UTF-8). Such a
string cannot be encoded as UTF-8, so it fails whatever writes it: a file or a pipe
into the sandbox, a strict log handler, the response. A number of more than 4300
digits fails Python's JSON parser, and a NaN fails a strict JSON encoder. One such
value in one item must not fail the items beside it, so each kind of value has a rule:

- text the model wrote (a completion, a tool call's arguments) is repaired: each lone
  surrogate becomes U+FFFD, what a decode with `errors="replace"` of the same bytes
  gives (and what moerl's byte tokenizer gives), and it is scored as repaired;
- reference data and names (a spec, a task, an id) must be valid: a value that is not
  is refused, naming its field (`invalid_spec`; the model is not charged for it);
- what goes back (a result's text and details) is escaped: a lone surrogate becomes
  the text `\\udc80`, a non-finite number or a value JSON cannot hold its `repr`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

MAX_NESTING = 64
"""Deepest nesting of lists and objects accepted in reference data (a spec, a task)."""
MAX_NUMBER_DIGITS = 4300
"""Python's default limit on the digits of an int converted from text."""
REPLACEMENT = "\ufffd"
_SHOWN = 40  # characters of a refused name shown in a message


class LongNumber:
    """Stands for a JSON integer with more digits than Python converts: the body still
    parses, and the item that holds it is refused by `invalid_value`."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<a number of {self.digits} digits>"


def _parse_int(text: str) -> int | LongNumber:
    digits = len(text.lstrip("-"))
    return int(text) if digits <= MAX_NUMBER_DIGITS else LongNumber(digits)


def loads(body: bytes | str) -> Any:
    """`json.loads` in which no single value fails the whole document: an overlong
    integer becomes a `LongNumber`. Raises ValueError (malformed JSON, or not UTF-8) and
    RecursionError (nested deeper than the interpreter's stack) for the whole body."""
    return json.loads(body, parse_int=_parse_int)


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate of `text`, or None when it is valid."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def repair_text(text: str) -> tuple[str, int]:
    """`text` with every lone surrogate replaced by U+FFFD, and how many were."""
    if lone_surrogate(text) is None:
        return text, 0
    replaced = sum("\ud800" <= c <= "\udfff" for c in text)
    return "".join(REPLACEMENT if "\ud800" <= c <= "\udfff" else c for c in text), replaced


def repair_values(value: Any, depth: int = 0) -> tuple[Any, int]:
    """`value` (decoded JSON) with `repair_text` applied to every string in it, keys
    included, and the count of replaced characters; ValueError when it nests deeper
    than MAX_NESTING (model-written values: the caller tells the model)."""
    if isinstance(value, str):
        return repair_text(value)
    if isinstance(value, (list, dict)) and depth >= MAX_NESTING:
        raise ValueError(f"nests deeper than {MAX_NESTING} levels")
    if isinstance(value, list):
        pairs = [repair_values(v, depth + 1) for v in value]
        return [v for v, _ in pairs], sum(n for _, n in pairs)
    if isinstance(value, dict):
        items = [(repair_text(k), repair_values(v, depth + 1)) for k, v in value.items()]
        return ({k: v for (k, _), (v, _) in items},
                sum(nk + nv for (_, nk), (_, nv) in items))  # fmt: skip
    return value, 0


def invalid_value(value: Any, where: str, depth: int = 0) -> str | None:
    """Why `value` (reference data, decoded JSON) cannot be used, naming the field as
    `where` plus its path inside (`spec.cases[2].input`); None when it can."""
    if isinstance(value, str):
        index = lone_surrogate(value)
        if index is not None:
            return (f"{where} holds a lone surrogate (U+{ord(value[index]):04X}) at character "
                    f"{index}: reference data must be valid Unicode")  # fmt: skip
        return None
    if isinstance(value, LongNumber):
        return f"{where} is a number of {value.digits} digits (at most {MAX_NUMBER_DIGITS})"
    if isinstance(value, (list, dict)) and depth >= MAX_NESTING:
        return f"{where} nests deeper than {MAX_NESTING} levels"
    if isinstance(value, list):
        return next((why for i, v in enumerate(value)
                     if (why := invalid_value(v, f"{where}[{i}]", depth + 1))), None)  # fmt: skip
    if isinstance(value, dict):
        for key, item in value.items():
            name = key if lone_surrogate(key) is None else repair_text(key)[0]
            why = invalid_value(key, f"a key of {where}", depth + 1) or invalid_value(
                item, f"{where}.{name[:_SHOWN]}", depth + 1)
            if why:
                return why
    return None


def json_safe(value: Any, depth: int = 0) -> tuple[Any, bool]:
    """`value` as plain JSON that encodes as UTF-8 whatever it held, and whether anything
    had to change: lone surrogates escaped as text, non-finite floats, overlong
    integers and values of other types as their `repr`, deeper nesting than
    MAX_NESTING cut. Containers are rebuilt; lists and dicts only come out."""
    if value is None or isinstance(value, bool):
        return value, False
    if isinstance(value, str):
        if lone_surrogate(value) is None:
            return value, False
        return value.encode("utf-8", "backslashreplace").decode("utf-8"), True
    if isinstance(value, int):
        if abs(value).bit_length() <= 3 * MAX_NUMBER_DIGITS:  # ~0.3 digits a bit: safe
            return int(value), False
        return f"<an integer of {abs(value).bit_length()} bits>", True
    if isinstance(value, float):
        return (float(value), False) if math.isfinite(value) else (repr(value), True)
    if depth >= MAX_NESTING and isinstance(value, (list, tuple, dict)):
        return "<nested too deeply>", True
    if isinstance(value, (list, tuple)):
        pairs = [json_safe(v, depth + 1) for v in value]
        return [v for v, _ in pairs], any(changed for _, changed in pairs)
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        changed = False
        for key, item in value.items():
            safe_key, key_changed = json_safe(key if isinstance(key, str) else repr(key))
            out[str(safe_key)], item_changed = json_safe(item, depth + 1)
            changed = changed or key_changed or item_changed or not isinstance(key, str)
        return out, changed
    return json_safe(_describe(value, repr))[0], True


def _describe(value: object, how: Callable[[object], str]) -> str:
    try:
        return how(value)
    except Exception:  # a value whose repr raises is still described
        return f"<a {type(value).__name__} that cannot be shown>"


def message(exc: BaseException) -> str:
    """The message of an exception, whatever its `__str__` does."""
    return _describe(exc, str)


def error_text(exc: BaseException) -> str:
    """`type: message` of an exception, whatever its `__str__` does."""
    return f"{type(exc).__name__}: {message(exc)}"
