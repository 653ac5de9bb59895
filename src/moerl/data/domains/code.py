"""The `code` domain: the generated HumanEval-style function tasks (moerl.data.code_tasks),
graded by running their unit tests in the sandbox (reward `humaneval`).

Options: `constants`, the digits the tasks' constants are drawn from (default 0-9).
The reference of every record is the correct body. The "eval" split is named from the
held-out function names (code_tasks.HELD_OUT_NAMES): its prompts never occur in "train".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moerl.data.code_tasks import make_tasks
from moerl.data.domains.options import check_keys
from moerl.data.prompts import PromptRecord


def generate(count: int, seed: int, split: str, options: Mapping[str, Any]) -> list[PromptRecord]:
    opts = check_keys(options, {"constants": None})
    constants = opts["constants"]
    if constants is not None and (not isinstance(constants, list) or not constants or any(
            not isinstance(c, int) or not 0 <= c <= 9 for c in constants)):
        raise ValueError("options.constants: a non-empty list of digits 0-9, or null for all")
    return [
        PromptRecord(uid=t.uid, prompt=t.prompt, reward="humaneval",
                     spec={"prompt": t.prompt, "test": t.tests, "entry_point": t.entry_point},
                     reference=t.reference)
        for t in make_tasks(count, seed, split, constants, held_out=split == "eval")
    ]
