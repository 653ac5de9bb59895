"""Prompt generators of the shipped domains (code, programs, math, documents, tools).

A generator makes a domain's prompts deterministically from a seed:

    generate(count, seed, split, options) -> list[PromptRecord]

`split` is "train" or "eval" (it prefixes the records' uids, so a held-out set never
shares a uid with training); `options` is the domain's `options` mapping from its
config, checked by the generator with errors that name the field. Every record names
the reward function that grades it (`PromptRecord.reward`), carries that function's
spec, and a reference completion that scores 1.0.

Generators import no torch: the reward server and config checks may load them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from moerl.data.prompts import PromptRecord

Generator = Callable[[int, int, str, Mapping[str, Any]], list[PromptRecord]]
