"""Format reward: the answer sits inside the expected tags, once, and is not empty."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from moerl.rewards.protocol import InvalidSpec, RewardResult

_TAG = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")


class FormatReward:
    """spec: {"tag": "answer", "require_think": false}. Reward 1.0 when the completion
    holds exactly one non-empty <tag>...</tag> (and, if asked, starts with a closed
    <think>...</think> block before it), else 0.0."""

    name = "format"

    def __init__(self, sandbox: object | None = None) -> None:
        pass

    def score(self, completion: str, spec: Mapping[str, Any]) -> RewardResult:
        tag = spec.get("tag", "answer")
        if not isinstance(tag, str) or not _TAG.match(tag):
            raise InvalidSpec(f"spec['tag'] must be a plain tag name, got {tag!r}")
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", completion, flags=re.DOTALL)
        opened = completion.count(f"<{tag}>")
        ok = len(blocks) == 1 and opened == 1 and blocks[0].strip() != ""
        if ok and spec.get("require_think", False):
            think = re.match(r"\s*<think>.*?</think>", completion, flags=re.DOTALL)
            ok = think is not None and completion.index(f"<{tag}>") >= think.end()
        return RewardResult(reward=1.0 if ok else 0.0, details={"answer_blocks": len(blocks)})
