"""Checks of a domain's `options` mapping shared by the generators; errors name the
option as `options.<field>`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_keys(options: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """`defaults` updated with `options`; a key of `options` that `defaults` lacks is
    refused (a misspelt option must not silently fall back to its default)."""
    unknown = sorted(str(key) for key in options if key not in defaults)
    if unknown:
        raise ValueError(f"options.{unknown[0]}: unknown option; this domain takes "
                         f"{sorted(defaults)}; remove it or correct its name")
    return {**defaults, **options}
