"""Checks of a generator's arguments and of typed `options` values, for the `programs`
and `math` domains. Errors are ValueErrors whose message names the option as
`options.<field>` and says what to write instead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SPLITS = ("train", "eval")


def check_call(count: int, split: str) -> None:
    """`count` is an integer >= 0 and `split` one of SPLITS."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"count: must be an integer >= 0, got {count!r}")
    if split not in SPLITS:
        raise ValueError(f"split: must be one of {list(SPLITS)}, got {split!r}")


def int_option(options: Mapping[str, Any], name: str, low: int, high: int) -> int:
    """options[name], an integer within [low, high]."""
    value = options[name]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"options.{name}: must be an integer from {low} to {high}, got "
                         f"{value!r}; set it within that range or leave it out for the "
                         "default")  # fmt: skip
    return value


def subset_option(options: Mapping[str, Any], name: str, choices: Sequence[str]) -> list[str]:
    """options[name], a non-empty list of distinct members of `choices` (null: all)."""
    value = options[name]
    if value is None:
        return list(choices)
    if (not isinstance(value, list) or not value or len(set(map(str, value))) != len(value)
            or any(not isinstance(v, str) or v not in choices for v in value)):  # fmt: skip
        raise ValueError(f"options.{name}: must be a non-empty list of distinct names out "
                         f"of {list(choices)}, got {value!r}; pick from those or leave it "
                         "out for all")  # fmt: skip
    return list(value)
