"""`--smoke` for every benchmark: the smallest sizes, to check it still runs end to end.

Not a benchmark itself (the leading underscore keeps it out of the smoke test's list).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any


def parse_with_smoke(parser: argparse.ArgumentParser, smoke: Mapping[str, Any],
                     argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser`'s arguments plus `--smoke`, which swaps in `smoke` as the defaults only,
    so options given explicitly still win."""
    parser.add_argument("--smoke", action="store_true",
                        help="smallest sizes: checks that the benchmark runs end to end")
    if parser.parse_known_args(argv)[0].smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args(argv)
