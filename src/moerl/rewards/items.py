"""One item of a `/score` request, checked and answered on its own: nothing an item
holds (a lone surrogate in its completion or spec, an overlong number, deep nesting, a
result whose details JSON cannot hold) can fail the other items of its batch. The
rules for each kind of value are in wire.py.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, Field, PrivateAttr, ValidationError

from moerl.rewards import wire
from moerl.rewards.protocol import REPAIRED, RewardResult


class ScoreItem(BaseModel):
    id: str = Field(min_length=1, max_length=200)
    reward: str = Field(min_length=1, max_length=200)
    completion: str
    spec: dict[str, Any] = Field(default_factory=dict)
    _repaired: int = PrivateAttr(default=0)

    @property
    def repaired(self) -> int:
        """Lone surrogates of the completion as sent, now U+FFFD."""
        return self._repaired


def parse_item(raw: Any, max_completion_bytes: int) -> ScoreItem | RewardResult:
    """The item, its completion made valid Unicode, or its invalid_spec result naming
    what is wrong with it. A completion over `max_completion_bytes` is refused by rule
    before it runs, so its size is never charged to the model as a timeout or a memory
    kill."""
    try:
        item = ScoreItem.model_validate(raw)
    except ValidationError as exc:
        where = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'item'}: {e['msg']}"
                          for e in exc.errors())  # fmt: skip
        return RewardResult.invalid(f"item rejected: {where}")
    why = (wire.invalid_value(item.id, "id") or wire.invalid_value(item.reward, "reward")
           or wire.invalid_value(item.spec, "spec"))  # fmt: skip
    if why is not None:
        return RewardResult.invalid(f"item rejected: {why}")
    item.completion, item._repaired = wire.repair_text(item.completion)
    size = len(item.completion.encode("utf-8"))
    if size > max_completion_bytes:
        return RewardResult.invalid(
            f"completion of {size} bytes is over this server's limit of {max_completion_bytes} "
            "(--max-completion-bytes); it was not run")
    return item


def with_repair_noted(result: RewardResult, item: ScoreItem) -> RewardResult:
    """`result`, saying in its details how much of the completion was repaired."""
    if not item.repaired:
        return result
    return replace(result, details={**result.details, REPAIRED: item.repaired})


def raw_id(raw: Any) -> str:
    """The id an item was sent with, for its row of the response ("" if it has none)."""
    item_id = raw.get("id") if isinstance(raw, dict) else None
    return item_id if isinstance(item_id, str) else ""


def fingerprint(item: ScoreItem) -> str:
    """What the item asks for, for telling a retry of it from another item with its id."""
    body = json.dumps([item.reward, item.completion, item.spec], sort_keys=True, default=repr)
    return hashlib.sha256(body.encode()).hexdigest()


def response_row(item_id: str, result: RewardResult) -> dict[str, Any]:
    """One item's row of the response, safe to encode whatever the program wrote or the
    reward function put in its details; `"escaped": true` says something was changed
    (see `wire.json_safe`). Details that cannot even be copied make it an infra error."""
    try:
        body = result.to_json()
    except Exception as exc:  # e.g. an object a plug-in put in its details
        body = RewardResult.infra(
            f"the result of this item cannot be sent: {wire.error_text(exc)}").to_json()
    row, escaped = wire.json_safe({"id": item_id, **body})
    if escaped:
        row["escaped"] = True
    return dict(row)
