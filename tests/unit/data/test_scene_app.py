"""The scene app: what each call does, failed calls change nothing, hard limits hold."""

from __future__ import annotations

from typing import Any

import pytest

from moerl.data.domains.scene_app import (
    COORD_LIMIT,
    MAX_CALLS_CAP,
    MAX_GROUP_DEPTH,
    MAX_ITEMS,
    MAX_NAME_CHARS,
    SceneApp,
    api_doc,
    canonical_json,
)


def call(call_name: str, /, **args: Any) -> dict[str, Any]:
    return {"call": call_name, "args": args}


def ok(app: SceneApp, call_name: str, /, **args: Any) -> dict[str, Any]:
    result = app.call(call(call_name, **args))
    assert result["ok"], result
    return result


def at(app: SceneApp, name: str) -> list[float]:
    return app.scene()["objects"][name]["at"]


def two_in_a_group() -> SceneApp:
    app = SceneApp(64)
    ok(app, "create", name="a", kind="cube", at=[0, 0, 0])
    ok(app, "create", name="b", kind="sphere", at=[2, 4, 6], size=2, material="red")
    ok(app, "group", name="g", members=["a", "b"])
    return app


def test_create_uses_the_documented_defaults_and_the_canonical_form() -> None:
    app = SceneApp()
    ok(app, "create", name="a", kind="cone")
    ok(app, "create", name="b", kind="cube", at=[1.5, -0.0, 2.0000000001], size=2.0,
       material="red")
    assert app.scene() == {
        "objects": {"a": {"kind": "cone", "at": [0, 0, 0], "size": 1, "material": "grey"},
                    "b": {"kind": "cube", "at": [1.5, 0, 2], "size": 2, "material": "red"}},
        "groups": {},
    }
    assert canonical_json(app.scene()).startswith('{"groups":{},"objects":{"a":')


def test_move_to_and_by_an_offset() -> None:
    app = SceneApp()
    ok(app, "create", name="a", kind="cube", at=[1, 2, 3])
    ok(app, "move", name="a", by=[1, -2, 0.5])
    assert at(app, "a") == [2, 0, 3.5]
    ok(app, "move", name="a", to=[-4, 5, 6])
    assert at(app, "a") == [-4, 5, 6]


def test_moving_a_group_moves_every_member_once_through_nested_groups() -> None:
    app = two_in_a_group()
    ok(app, "create", name="c", kind="plane", at=[10, 10, 10])
    ok(app, "group", name="outer", members=["g", "c", "a"])  # a sits in both groups
    ok(app, "move", name="outer", by=[1, 1, 1])
    assert (at(app, "a"), at(app, "b"), at(app, "c")) == ([1, 1, 1], [3, 5, 7], [11, 11, 11])
    ok(app, "move", name="g", to=[0, 0, 0])  # the members' mean position goes there
    assert (at(app, "a"), at(app, "b"), at(app, "c")) == ([-1, -2, -3], [1, 2, 3],
                                                          [11, 11, 11])


def test_set_material_on_a_group_paints_its_members_only() -> None:
    app = two_in_a_group()
    ok(app, "create", name="c", kind="plane")
    ok(app, "set_material", name="g", material="gold")
    materials = {n: o["material"] for n, o in app.scene()["objects"].items()}
    assert materials == {"a": "gold", "b": "gold", "c": "grey"}


def test_an_existing_group_gets_members_added() -> None:
    app = two_in_a_group()
    ok(app, "create", name="c", kind="plane")
    ok(app, "group", name="g", members=["c"])
    assert app.scene()["groups"] == {"g": ["a", "b", "c"]}


def test_group_cycles_are_refused() -> None:
    app = two_in_a_group()
    ok(app, "group", name="h", members=["g"])
    ok(app, "group", name="top", members=["h"])
    before = app.scene()
    for members in (["top"], ["h"], ["g"]):
        result = app.call(call("group", name="g", members=members))
        assert not result["ok"] and "itself" in result["error"]
    assert app.scene() == before
    assert app.error_count == 3


def test_deleting_a_grouped_object_takes_it_out_of_its_groups() -> None:
    app = two_in_a_group()
    ok(app, "group", name="h", members=["a"])
    ok(app, "delete", name="a")
    assert app.scene()["groups"] == {"g": ["b"], "h": []}
    assert set(app.scene()["objects"]) == {"b"}
    ok(app, "move", name="g", by=[1, 0, 0])
    assert at(app, "b") == [3, 4, 6]


def test_deleting_a_group_keeps_its_members() -> None:
    app = two_in_a_group()
    ok(app, "group", name="outer", members=["g"])
    ok(app, "delete", name="g")
    assert app.scene()["groups"] == {"outer": []}
    assert set(app.scene()["objects"]) == {"a", "b"}


def test_query_reports_state_and_changes_nothing() -> None:
    app = two_in_a_group()
    before = canonical_json(app.scene())
    assert ok(app, "query", name="b")["state"] == {
        "kind": "sphere", "at": [2, 4, 6], "size": 2, "material": "red", "groups": ["g"]}
    assert ok(app, "query", name="g")["state"] == {"members": ["a", "b"], "at": [1, 2, 3]}
    assert canonical_json(app.scene()) == before
    assert app.error_count == 0


@pytest.mark.parametrize("request_", [
    "create",
    ["create", {}],
    {"call": "create"},
    {"call": "create", "args": {"name": "x", "kind": "cube"}, "extra": 1},
    call("explode", name="a"),
    {"call": 7, "args": {}},
    {"call": "create", "args": []},
    call("create", name="a", kind="cube"),  # a duplicate name
    call("create", name="g", kind="cube"),  # the group's name
    call("create", name="new", kind="torus"),
    call("create", name="new", kind="cube", colour="red"),
    call("create", name="new", kind="cube", at=[1, 2]),
    call("create", name="new", kind="cube", at=["1", 2, 3]),
    call("create", name="new", kind="cube", at=[True, 2, 3]),
    call("create", name="new", kind="cube", size=0),
    call("create", name="new", kind="cube", size=-1),
    call("create", name="new", kind="cube", material="dark red"),
    call("create", name="1abc", kind="cube"),
    call("create", kind="cube"),
    call("move", name="nobody", by=[1, 1, 1]),
    call("move", name="a", by=[1, 1, 1], to=[0, 0, 0]),
    call("move", name="a"),
    call("move", name="g", by=[COORD_LIMIT, 0, 0]),  # b would leave the bounds
    call("group", name="g2", members=["a", "ghost"]),
    call("group", name="g2", members=["a", "a"]),
    call("group", name="g2", members="a"),
    call("group", name="a", members=["b"]),  # a is an object
    call("group", name="g", members=["a"]),  # already a member
    call("set_material", name="g", material=3),
    call("set_material", name="ghost", material="red"),
    call("delete", name="ghost"),
    call("delete", name=["a"]),
    call("query", name="ghost"),
])
def test_an_invalid_call_is_an_error_and_leaves_the_state_unchanged(request_: object) -> None:
    app = two_in_a_group()
    before = canonical_json(app.scene())
    result = app.call(request_)
    assert result["ok"] is False and isinstance(result["error"], str)
    assert canonical_json(app.scene()) == before
    assert app.error_count == 1 and app.errors == [result["error"]]


@pytest.mark.parametrize("value", [1e308, -1e308, float("inf"), float("nan"), 10**400,
                                   COORD_LIMIT + 1])
def test_coordinates_must_be_finite_and_within_bounds(value: float) -> None:
    app = SceneApp()
    assert not app.call(call("create", name="a", kind="cube", at=[0, value, 0]))["ok"]
    ok(app, "create", name="b", kind="cube")
    assert not app.call(call("move", name="b", to=[value, 0, 0]))["ok"]
    assert not app.call(call("move", name="b", by=[0, 0, value]))["ok"]
    assert app.scene()["objects"] == {
        "b": {"kind": "cube", "at": [0, 0, 0], "size": 1, "material": "grey"}}


def test_calls_past_the_limit_are_not_run() -> None:
    app = SceneApp(max_calls=3)
    calls = [call("create", name=f"o{i}", kind="cube") for i in range(100_000)]
    results = app.run(calls)
    assert len(results) == 3 and set(app.scene()["objects"]) == {"o0", "o1", "o2"}
    assert app.error_count == 1 and "99997 calls not run" in app.errors[0]
    assert app.call(call("create", name="late", kind="cube"))["ok"] is False
    assert app.calls_made == 3


@pytest.mark.parametrize("max_calls", [0, -1, MAX_CALLS_CAP + 1, True, 2.0])
def test_the_call_limit_itself_is_bounded(max_calls: Any) -> None:
    with pytest.raises(ValueError, match="max_calls"):
        SceneApp(max_calls)


def test_the_scene_holds_at_most_max_items() -> None:
    app = SceneApp(MAX_CALLS_CAP)
    app.run([call("create", name=f"o{i}", kind="cube") for i in range(MAX_ITEMS + 10)])
    assert len(app.scene()["objects"]) == MAX_ITEMS
    assert app.error_count == 10 and "full" in app.errors[0]
    assert not app.call(call("group", name="g", members=["o0"]))["ok"]


def test_long_names_are_refused_and_not_echoed_whole() -> None:
    app = SceneApp()
    ok(app, "create", name="n" * MAX_NAME_CHARS, kind="cube")
    result = app.call(call("create", name="x" * 1_000_000, kind="cube"))
    assert not result["ok"] and len(result["error"]) < 300
    assert len(app.scene()["objects"]) == 1


def test_groups_nest_at_most_max_group_depth() -> None:
    app = SceneApp()
    ok(app, "create", name="a", kind="cube")
    ok(app, "group", name="g1", members=["a"])
    for level in range(2, MAX_GROUP_DEPTH + 1):
        ok(app, "group", name=f"g{level}", members=[f"g{level - 1}"])
    deeper = app.call(call("group", name="top", members=[f"g{MAX_GROUP_DEPTH}"]))
    assert not deeper["ok"] and "deep" in deeper["error"]
    # Deepening from below counts too: g1 is nested MAX_GROUP_DEPTH - 1 levels down.
    ok(app, "create", name="b", kind="cube")
    ok(app, "group", name="inner", members=["b"])
    assert not app.call(call("group", name="g1", members=["inner"]))["ok"]
    assert "top" not in app.scene()["groups"] and app.scene()["groups"]["g1"] == ["a"]


def test_the_api_doc_is_short_and_names_every_call() -> None:
    doc = api_doc()
    assert len(doc) < 600
    for name in ("create", "move", "group", "set_material", "delete", "query"):
        assert f"\n{name}:" in doc
