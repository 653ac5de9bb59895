"""The tools domain end to end: generated tasks, their references, and the scene reward
on wrong, malformed and hostile answers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from moerl.data.domains.scene_app import SceneApp, api_doc
from moerl.data.domains.tools import format_calls, generate
from moerl.rewards.protocol import InvalidSpec, RewardFunction
from moerl.rewards.tools import MAX_JSON_DEPTH, SceneReward, json_depth

REWARD = SceneReward()


def call(call_name: str, /, **args: Any) -> dict[str, Any]:
    return {"call": call_name, "args": args}


REFERENCE = [
    call("create", name="ant", kind="cube", at=[1, 2, 0], material="red"),
    call("create", name="bee", kind="sphere", at=[1, 2, 3], size=2),
    call("create", name="cat", kind="cone", at=[-3, 0, 1], material="wood"),
    call("group", name="zoo", members=["ant", "bee"]),
    call("move", name="zoo", by=[2, 0, -1]),
]


def spec_of(calls: list[dict[str, Any]], max_calls: int = 32) -> dict[str, Any]:
    app = SceneApp(max_calls)
    app.run(calls)
    assert app.error_count == 0
    return {"target": app.scene(), "max_calls": max_calls}


SPEC = spec_of(REFERENCE)


def score(calls: Any, spec: dict[str, Any] = SPEC) -> float:
    text = calls if isinstance(calls, str) else format_calls(calls)
    reward = REWARD.score(text, spec).reward
    assert reward is not None
    return reward


@pytest.mark.parametrize("options", [
    {}, {"with_groups": False}, {"objects": [1, 8]}, {"objects": 5, "max_calls": 9},
])
def test_generated_references_score_one(options: dict[str, Any]) -> None:
    records = [r for seed in range(3) for r in generate(20, seed, "train", options)]
    records += generate(10, 0, "eval", options)
    for record in records:
        assert record.reward == "scene"
        assert record.reference is not None
        result = REWARD.score(record.reference, record.spec)
        assert result.reward == 1.0, (record.uid, record.prompt, result.details)


def test_generated_tasks_use_groups_moves_deletes_and_relative_positions() -> None:
    records = generate(60, 0, "train", {})
    references = " ".join(r.reference or "" for r in records)
    prompts = " ".join(r.prompt for r in records)
    for piece in ('"call":"group"', '"call":"move"', '"call":"delete"',
                  '"call":"set_material"'):
        assert piece in references
    assert " + (" in prompts  # a position relative to an earlier object
    assert '"call":"group"' not in " ".join(
        r.reference or "" for r in generate(30, 0, "train", {"with_groups": False}))


def test_prompts_hold_the_api_the_task_and_the_answer_format() -> None:
    records = generate(50, 7, "train", {})
    for record in records:
        assert record.prompt.startswith(api_doc())
        assert "<calls>...</calls>" in record.prompt and "at most 32 calls" in record.prompt
        assert len(record.prompt) < 1000
        assert record.spec["max_calls"] == 32
        json.dumps(record.spec)  # travels as JSON


def test_generation_is_deterministic_and_seeds_and_splits_differ() -> None:
    first, again = generate(20, 1, "train", {}), generate(20, 1, "train", {})
    assert first == again
    other_seed = generate(20, 2, "train", {})
    assert len({r.prompt for r in first} & {r.prompt for r in other_seed}) <= 2
    held_out = generate(20, 1, "eval", {})
    uids = [r.uid for r in first + other_seed + held_out]
    assert len(set(uids)) == len(uids)
    assert all(r.uid.startswith("eval-") for r in held_out)
    assert {r.prompt for r in first} != {r.prompt for r in held_out}


@pytest.mark.parametrize(("options", "field"), [
    ({"objcts": 2}, "objcts"),
    ({"objects": 0}, "objects"),
    ({"objects": [3, 2]}, "objects"),
    ({"objects": [1, 9]}, "objects"),
    ({"objects": "3"}, "objects"),
    ({"with_groups": "yes"}, "with_groups"),
    ({"max_calls": 3}, "max_calls"),
    ({"max_calls": 10_000}, "max_calls"),
    ({"max_calls": True}, "max_calls"),
])
def test_option_errors_name_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^options\.{field}: "):
        generate(1, 0, "train", options)


def test_split_and_count_are_checked() -> None:
    with pytest.raises(ValueError, match="split"):
        generate(1, 0, "test", {})
    with pytest.raises(ValueError, match="count"):
        generate(-1, 0, "train", {})


def with_replaced(index: int, new: dict[str, Any]) -> list[dict[str, Any]]:
    return [new if i == index else c for i, c in enumerate(REFERENCE)]


def test_wrong_answers_earn_ordered_partial_credit_below_one() -> None:
    exact = score(REFERENCE)
    wrong_material = score(with_replaced(2, call("create", name="cat", kind="cone",
                                                 at=[-3, 0, 1], material="gold")))
    missing_move = score(REFERENCE[:-1])
    extra_object = score([*REFERENCE, call("create", name="dog", kind="cube")])
    wrong_group = score(with_replaced(3, call("group", name="zoo", members=["ant"])))
    half = score(REFERENCE[:1])
    empty = score([])
    assert exact == 1.0
    for near_miss in (wrong_material, missing_move, extra_object, wrong_group):
        assert half < near_miss < 1.0
    assert wrong_material > missing_move  # one property wrong vs. two positions wrong
    assert half > 0.0 and empty == 0.0


def test_the_same_scene_by_another_route_scores_one() -> None:
    final = SPEC["target"]["objects"]
    direct = [call("create", name=n, **o) for n, o in final.items()]
    route = [*direct, call("query", name="ant"), call("group", name="zoo", members=["bee"]),
             call("group", name="zoo", members=["ant"]), call("explode", name="x")]
    assert score(route) == 1.0


def test_only_the_last_calls_block_counts_and_details_say_why() -> None:
    assert score(format_calls([]) + " then " + format_calls(REFERENCE)) == 1.0
    assert score(format_calls(REFERENCE) + " no: " + format_calls(REFERENCE[:1])) < 1.0
    details = REWARD.score(format_calls([*REFERENCE, call("delete", name="ghost")]),
                           SPEC).details
    assert details["calls"] == 6 and details["errors"] == 1 and details["exact"] is True


def test_calls_past_max_calls_are_not_run() -> None:
    spec = {**SPEC, "max_calls": 4}
    assert score(REFERENCE, spec) < 1.0  # the move is the fifth call
    assert REWARD.score(format_calls(REFERENCE), spec).details["calls"] == 4


@pytest.mark.parametrize("completion", [
    "I would create a cube.",
    '[{"call": "create", "args": {"name": "ant", "kind": "cube"}}]',  # no tag
    "<calls>[{'call': 'create'}]</calls>",
    "<calls>[1, 2,</calls>",
    '<calls>{"call": "create", "args": {"name": "ant", "kind": "cube"}}</calls>',
    '<calls>"create ant"</calls>',
    "<calls></calls>",
    '<calls>[["create", {"name": "ant", "kind": "cube"}]]</calls>',
    '<calls>[{"create": {"name": "ant", "kind": "cube"}}]</calls>',
    '<calls>[{"call": "create", "args": ["ant", "cube"]}]</calls>',
    '<calls>[null, 1, "x", []]</calls>',
    "</calls>[]<calls>",
])
def test_malformed_answers_score_zero(completion: str) -> None:
    result = REWARD.score(completion, SPEC)
    assert result.reward == 0.0 and result.error_kind is None


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE = {
    "100k calls": format_calls([call("create", name=f"o{i}", kind="cube")
                                for i in range(100_000)]),
    "100k empty calls": "<calls>[" + ",".join(["{}"] * 100_000) + "]</calls>",
    "20k empty calls, parsed": "<calls>[" + ",".join(["{}"] * 20_000) + "]</calls>",
    "10 MB without a tag": "x" * 10_000_000,
    "10 MB in the tag": "<calls>[" + "1," * 5_000_000 + "1]</calls>",
    "10 MB string": '<calls>["' + "a" * 10_000_000 + '"]</calls>',
    "many unclosed tags": "<calls>" * 1_000_000 + "</calls>" * 10,
    "nesting 100k": f"<calls>{deep(100_000)}</calls>",
    "nesting just past the limit": f"<calls>{deep(MAX_JSON_DEPTH + 1)}</calls>",
    "escaped quotes, unterminated": "<calls>" + '"\\"' * 20_000 + "</calls>",
    "huge int": "<calls>[" + "9" * 50_000 + "]</calls>",
    "1e308": format_calls([call("create", name="ant", kind="cube", at=[1e308, 0, 0])]),
    "1e400 (inf)": '<calls>[{"call":"create","args":{"name":"ant","kind":"cube",'
                   '"at":[1e400,0,0]}}]</calls>',
    "NaN": '<calls>[{"call":"create","args":{"name":"ant","kind":"cube",'
           '"at":[NaN,0,0]}}]</calls>',
    "Infinity": '<calls>[{"call":"move","args":{"name":"ant","by":[-Infinity,0,0]}}]</calls>',
    "1 MB name": format_calls([call("create", name="n" * 1_000_000, kind="cube")]),
    "60 kB name": format_calls([call("create", name="n" * 60_000, kind="cube")]),
    "thousands of objects": format_calls([call("create", name=f"o{i}", kind="cube")
                                          for i in range(1_000)]),
    "group cycles": format_calls(
        [call("create", name="ant", kind="cube"), call("group", name="g", members=["ant"]),
         call("group", name="h", members=["g"]), call("group", name="g", members=["h"])]
        + [call("move", name="g", by=[1, 1, 1])] * 20),
    "huge member list": format_calls([call("create", name="ant", kind="cube"),
                                      call("group", name="g", members=["ant"] * 5_000)]),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_answers_are_contained_and_fast(name: str) -> None:
    spec = {**SPEC, "max_calls": 256}
    started = time.perf_counter()
    result = REWARD.score(HOSTILE[name], spec)
    elapsed = time.perf_counter() - started
    assert result.error_kind is None and result.reward is not None
    assert 0.0 <= result.reward < 1.0
    assert elapsed < 1.0, f"{name} took {elapsed:.2f} s"
    assert len(json.dumps(result.details)) < 2_000


@pytest.mark.parametrize("block", [
    deep(30_000), deep(900), deep(MAX_JSON_DEPTH + 1),
    '[{"call":"create","args":{"name":"a","kind":"cube","at":[[[[0]]],0,0]}}]',
])
def test_nesting_is_refused_before_parsing(block: str) -> None:
    result = REWARD.score(f"<calls>{block}</calls>", SPEC)
    assert result.reward == 0.0 and "deeper" in str(result.details["malformed"])
    assert score(f"<calls>{deep(MAX_JSON_DEPTH)}</calls>") == 0.0  # parsed, not calls


def test_json_depth_ignores_brackets_inside_strings() -> None:
    assert json_depth('[{"a": "[[[[[[[[", "b": [1, "]]\\"]]"]}]') == 3
    assert json_depth(deep(9)) == 9 and json_depth("") == 0


@pytest.mark.parametrize("spec", [
    {},
    {"target": SPEC["target"]},
    {"target": SPEC["target"], "max_calls": 0},
    {"target": SPEC["target"], "max_calls": "32"},
    {"target": [], "max_calls": 32},
    {"target": {"objects": {}}, "max_calls": 32},
    {"target": {"objects": {"a": {"kind": "cube"}}, "groups": {}}, "max_calls": 32},
    {"target": {"objects": {"a": {"kind": "cube", "at": [0, 0, float("nan")], "size": 1,
                                  "material": "grey"}}, "groups": {}}, "max_calls": 32},
    {"target": {"objects": {}, "groups": {"g": ["h"], "h": ["g"]}}, "max_calls": 32},
    {"target": {"objects": {}, "groups": {"g": ["ghost"]}}, "max_calls": 32},
])
def test_malformed_specs_raise_invalid_spec(spec: dict[str, Any]) -> None:
    with pytest.raises(InvalidSpec):
        REWARD.score(format_calls(REFERENCE), spec)


def test_a_target_with_nested_and_empty_groups_is_accepted() -> None:
    calls = [call("create", name="a", kind="cube"), call("group", name="inner", members=["a"]),
             call("group", name="outer", members=["inner"]), call("group", name="e", members=[])]
    assert score(calls, spec_of(calls)) == 1.0


def test_scene_reward_is_a_reward_function_and_thread_safe() -> None:
    assert isinstance(SceneReward(object()), RewardFunction) and REWARD.name == "scene"
    records = generate(40, 3, "train", {})
    jobs = [(r.reference or "", r.spec) for r in records] + [("<calls>[]</calls>", SPEC)] * 40
    with ThreadPoolExecutor(8) as pool:
        rewards = list(pool.map(lambda job: REWARD.score(*job).reward, jobs))
    assert rewards == [1.0] * 40 + [0.0] * 40


def test_the_domain_modules_import_no_torch() -> None:
    code = ("import sys, moerl.rewards.tools, moerl.data.domains.tools; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
