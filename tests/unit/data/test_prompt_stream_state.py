"""PromptStream state: a checkpoint's JSON round trip continues the same order."""

from __future__ import annotations

import json

import pytest

from moerl.data.prompt_sources import load_prompts
from moerl.data.prompts import DataConfig, DatasetError, PromptRecord, PromptStream


def _records(size: int = 7, seed: int = 0) -> list[PromptRecord]:
    return load_prompts(DataConfig(train_size=size, eval_size=1, seed=seed))[0]


@pytest.mark.parametrize("taken", [0, 3, 7, 12])  # within, at and past an epoch's end
def test_state_round_trip_continues_the_order(taken: int) -> None:
    records = _records()
    whole = [r.uid for r in PromptStream(records, seed=5).take(taken + 9)]
    first = PromptStream(records, seed=5)
    before = [r.uid for r in first.take(taken)]
    saved = json.loads(json.dumps(first.state()))  # through JSON, as a checkpoint holds it
    assert saved == {"position": taken, "seed": 5, "size": 7}
    resumed = PromptStream(records, seed=5)
    resumed.restore(saved)
    assert before + [r.uid for r in resumed.take(9)] == whole


@pytest.mark.parametrize(("change", "field"), [({"seed": 6}, "seed"), ({"size": 8}, "size")])
def test_restore_into_another_order_is_refused(change: dict[str, int], field: str) -> None:
    stream = PromptStream(_records(), seed=5)
    state = {**stream.state(), "position": 4, **change}
    with pytest.raises(DatasetError, match=f"saved {field}"):
        stream.restore(state)
    assert stream.position == 0
    stream.restore(state, strict=False)  # checkpoint.allow_changed_data: keep the position
    assert stream.position == 4


@pytest.mark.parametrize("position", [None, -1, "3", True])
def test_restore_rejects_a_bad_position(position: object) -> None:
    stream = PromptStream(_records(), seed=0)
    with pytest.raises(DatasetError, match="'position' must be an int"):
        stream.restore({"position": position, "seed": 0, "size": 7})
