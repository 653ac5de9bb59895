"""A reward plug-in for runs of a fresh (untrained) model: the share of a completion's
characters that are ASCII letters. Random text scores anywhere in [0, 1], so every
group of samples has a spread and every objective gets advantages to act on; the
built-in rewards score such text 0 throughout. Served through `--reward
letter_share=text_rewards:LetterShare` (`+rewards.plugins.letter_share=...` for `moerl
train`), as a user's plug-in is."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moerl.rewards.protocol import RewardResult


class LetterShare:
    name = "letter_share"

    def __init__(self, sandbox: object | None = None) -> None:
        pass

    def score(self, completion: str, spec: Mapping[str, Any]) -> RewardResult:
        letters = sum(c.isascii() and c.isalpha() for c in completion)
        return RewardResult(reward=letters / len(completion) if completion else 0.0)


PLUGIN = "letter_share=text_rewards:LetterShare"


def letter_prompts(path: Path, count: int = 8) -> Path:
    """A JSONL prompt set (`data.source=jsonl data.path=...`) graded by LetterShare."""
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Say something, {i}.",
                                        "reward": "letter_share", "spec": {}}) + "\n"
                            for i in range(count)))
    return path
