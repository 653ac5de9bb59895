"""Each value of an item made safe on its own (wire.py, items.py): model text repaired,
reference data refused naming the field, results escaped so they always encode."""

import json
import math
import threading

import pytest

from moerl.rewards import wire
from moerl.rewards.items import parse_item, response_row
from moerl.rewards.protocol import RewardResult


def encodes(value: object) -> bool:
    """What the server's response does with a row: strict JSON, raw UTF-8."""
    json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    return True


def test_model_text_is_repaired_as_a_replacing_decode_would_have_read_its_bytes() -> None:
    raw = b"ok \xff\xfe done"
    escaped = raw.decode("utf-8", "surrogateescape")
    assert wire.repair_text(escaped) == (raw.decode("utf-8", "replace"), 2)
    valid = "naïve 🙂"
    assert wire.repair_text(valid) == (valid, 0)
    repaired, count = wire.repair_values({"cmd\udc80": ["echo \ud800", 3, {"k": "\udfff"}]})
    assert repaired == {"cmd\ufffd": ["echo \ufffd", 3, {"k": "\ufffd"}]} and count == 3
    deep: object = "x"
    for _ in range(wire.MAX_NESTING + 1):
        deep = [deep]
    with pytest.raises(ValueError, match="nests deeper than"):
        wire.repair_values(deep)


def test_reference_data_is_refused_naming_the_field() -> None:
    assert wire.invalid_value({"cases": [{"input": "ok"}]}, "spec") is None
    why = wire.invalid_value({"cases": [{"input": "a", "output": "b\udc80"}]}, "spec")
    assert why is not None and why.startswith("spec.cases[0].output holds a lone surrogate "
                                              "(U+DC80) at character 1")  # fmt: skip
    assert "a key of spec" in (wire.invalid_value({"\ud800": 1}, "spec") or "")
    deep: object = 1
    for _ in range(wire.MAX_NESTING + 1):
        deep = [deep]
    assert "nests deeper than" in (wire.invalid_value(deep, "spec") or "")
    number = wire.loads('{"n": ' + "9" * 5000 + ', "m": 12}')
    assert number["m"] == 12 and isinstance(number["n"], wire.LongNumber)
    assert wire.invalid_value(number, "spec") == "spec.n is a number of 5000 digits (at most 4300)"


def test_whatever_a_result_holds_comes_back_as_encodable_json() -> None:
    deep: object = "leaf"
    for _ in range(wire.MAX_NESTING + 5):
        deep = {"d": deep}
    odd = {"text": "\udc80", "nan": math.nan, "inf": -math.inf, "obj": object(),
           "tuple": (1, "x"), 3: "int key", "big": 10**5000, "deep": deep}  # fmt: skip
    safe, changed = wire.json_safe(odd)
    assert changed and encodes(safe)
    assert safe["text"] == "\\udc80" and safe["nan"] == "nan" and safe["inf"] == "-inf"
    assert safe["tuple"] == [1, "x"] and safe["3"] == "int key"
    assert safe["big"].startswith("<an integer of")
    assert wire.json_safe({"a": [1, 2.5, None, True, "é"]}) == ({"a": [1, 2.5, None, True, "é"]},
                                                               False)  # fmt: skip


def test_an_item_is_checked_field_by_field() -> None:
    item = parse_item({"id": "a", "reward": "stdio", "completion": "x\udc80", "spec": {}}, 100)
    assert not isinstance(item, RewardResult)
    assert item.completion == "x\ufffd" and item.repaired == 1
    for raw, why in [
        ({"id": "a\udc80", "reward": "stdio", "completion": ""}, "item rejected: id"),
        ({"id": "a", "reward": "stdio", "completion": "", "spec": {"t": "\udc80"}}, "spec.t"),
        ({"id": "a", "reward": "stdio", "completion": 3}, "completion"),
        ([1, 2], "item rejected"),
    ]:
        refused = parse_item(raw, 100)
        assert isinstance(refused, RewardResult) and refused.error_kind == "invalid_spec"
        assert why in (refused.error or ""), refused


@pytest.mark.parametrize("details", [{"lock": threading.Lock()}, {"nan": math.nan}])
def test_a_row_always_encodes(details: dict[str, object]) -> None:
    row = response_row("id", RewardResult(reward=1.0, details=details))  # type: ignore[arg-type]
    assert encodes(row) and row["id"] == "id"
    if "lock" in details:  # cannot even be copied: the reward function's fault, infra
        assert row["error_kind"] == "infra" and "cannot be sent" in row["error"]
    else:
        assert row["reward"] == 1.0 and row["escaped"] is True
