"""Scene reward (the `tools` domain): run the answer's API calls on a fresh scene app and
compare the scene they leave with the target.

Everything runs in the reward server's process as plain Python: the answer is parsed as
JSON data (never executed as code), its size and nesting are checked before parsing, and
the app's own limits bound what the calls can do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from itertools import accumulate
from typing import Any, NoReturn

from moerl.data.domains.scene_app import MAX_CALLS_CAP, MAX_ITEMS, SceneApp
from moerl.rewards.protocol import JSON, InvalidSpec, RewardResult

MAX_ANSWER_CHARS = 64_000
"""Longest <calls> block parsed; 256 calls of ordinary size fit in well under half."""
MAX_JSON_DEPTH = 6
"""Deepest bracket nesting parsed (a valid answer needs 4: array, call, args, vector)."""
EXTRA_PENALTY = 0.5
"""Partial credit lost per extra object or group, as a share of one target item."""
BELOW_EXACT = 0.99
"""The most a scene that differs from the target can score."""
OBJECT_PROPERTIES = ("kind", "at", "size", "material")
_OPEN, _CLOSE = "<calls>", "</calls>"
# A JSON string (closed or running to the end, linear time) or one bracket.
_TOKEN = re.compile(r'"[^"\\]*(?:\\[\s\S][^"\\]*)*"?|[\[\]{}]')
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class MalformedAnswer(ValueError):
    """The completion holds no usable list of calls; the message says why."""


def _no_constants(name: str) -> NoReturn:
    raise MalformedAnswer(f"{name} is not a JSON number")


def json_depth(text: str) -> int:
    """The deepest bracket nesting of `text`, brackets inside strings ignored."""
    steps = (_DEPTH_STEP.get(token, 0) for token in _TOKEN.findall(text))
    return max(accumulate(steps), default=0)


def extract_calls(completion: str) -> list[Any]:
    """The JSON array inside the last <calls>...</calls>; MalformedAnswer otherwise."""
    end = completion.rfind(_CLOSE)
    start = completion.rfind(_OPEN, 0, max(end, 0))
    if end < 0 or start < 0:
        raise MalformedAnswer("no <calls>...</calls> block")
    text = completion[start + len(_OPEN):end]
    if len(text) > MAX_ANSWER_CHARS:
        raise MalformedAnswer(f"the calls block is longer than {MAX_ANSWER_CHARS} characters")
    if json_depth(text) > MAX_JSON_DEPTH:
        raise MalformedAnswer(f"the calls nest deeper than {MAX_JSON_DEPTH}")
    try:
        value = json.loads(text, parse_constant=_no_constants)
    except MalformedAnswer:
        raise
    except (ValueError, RecursionError) as err:  # ValueError covers JSONDecodeError
        raise MalformedAnswer(f"not JSON: {str(err)[:80]}") from None
    if not isinstance(value, list):
        raise MalformedAnswer(f"expected a JSON array of calls, got a {type(value).__name__}")
    return value


def load_target(data: object) -> dict[str, Any]:
    """The canonical form of a spec's target scene, rebuilt with create and group calls
    on a fresh app, so that it obeys the app's own rules; InvalidSpec naming the fault."""
    shape = 'spec["target"] must be {"objects": {name: {kind, at, size, material}}, ' \
        '"groups": {name: [names]}}'
    if not isinstance(data, dict) or set(data) != {"objects", "groups"}:
        raise InvalidSpec(shape)
    objects, groups = data["objects"], data["groups"]
    if not isinstance(objects, dict) or not isinstance(groups, dict) or any(
            not isinstance(o, dict) or set(o) != set(OBJECT_PROPERTIES)
            for o in objects.values()):
        raise InvalidSpec(shape)
    if len(objects) + len(groups) > MAX_ITEMS:
        raise InvalidSpec(f'spec["target"] holds more than {MAX_ITEMS} objects and groups')
    calls = [{"call": "create", "args": {"name": name, **obj}} for name, obj in objects.items()]
    calls += [{"call": "group", "args": {"name": name, "members": []}} for name in groups]
    calls += [{"call": "group", "args": {"name": name, "members": members}}
              for name, members in groups.items()]
    app = SceneApp(MAX_CALLS_CAP)
    app.run(calls)
    if app.error_count:
        raise InvalidSpec(f'spec["target"]: {app.errors[0]}')
    return app.scene()


def match_scene(scene: Mapping[str, Any], target: Mapping[str, Any]) -> tuple[float, int]:
    """(matched, extra): the mean credit over the target's objects and groups (an object:
    the share of its properties that are right; a group: the overlap of its member set
    with the target's, |common| / |either|) and the count of objects and groups the
    target does not have."""
    want_objects, want_groups = target["objects"], target["groups"]
    got_objects, got_groups = scene["objects"], scene["groups"]
    credit = 0.0
    for name, want in want_objects.items():
        got = got_objects.get(name)
        if got is not None:
            credit += sum(got[p] == want[p] for p in OBJECT_PROPERTIES) / len(OBJECT_PROPERTIES)
    for name, want_members in want_groups.items():
        if name in got_groups:
            got, want_set = set(got_groups[name]), set(want_members)
            credit += len(got & want_set) / len(got | want_set) if got | want_set else 1.0
    total = len(want_objects) + len(want_groups)
    extra = len(set(got_objects) - set(want_objects)) + len(set(got_groups) - set(want_groups))
    return (credit / total if total else 1.0), extra


class SceneReward:
    """spec: {"target": canonical scene (`moerl.data.domains.scene_app`), "max_calls": int
    in [1, 256]}. The completion's last <calls>[{"call": ..., "args": {...}}, ...]</calls>
    is run on a fresh app (calls past max_calls are not run). Reward 1.0 exactly when the
    final scene equals the target; otherwise matched - EXTRA_PENALTY * extra / target
    items (see `match_scene`), floored at 0 and at most BELOW_EXACT. A completion without
    a parsable array of calls scores 0.0."""

    name = "scene"

    def __init__(self, sandbox: object | None = None) -> None:
        pass

    def score(self, completion: str, spec: Mapping[str, Any]) -> RewardResult:
        target = load_target(spec.get("target"))
        max_calls = spec.get("max_calls")
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or not (
                1 <= max_calls <= MAX_CALLS_CAP):
            raise InvalidSpec(f"spec['max_calls'] must be an int in [1, {MAX_CALLS_CAP}], "
                              f"got {max_calls!r}")
        try:
            calls = extract_calls(completion)
        except MalformedAnswer as err:
            return RewardResult(reward=0.0, details={"malformed": str(err)})
        app = SceneApp(max_calls)
        app.run(calls)
        scene = app.scene()
        matched, extra = match_scene(scene, target)
        exact = scene == target
        items = max(1, len(target["objects"]) + len(target["groups"]))
        partial = min(BELOW_EXACT, max(0.0, matched - EXTRA_PENALTY * extra / items))
        errors: list[JSON] = [message for message in app.errors[:4]]
        return RewardResult(reward=1.0 if exact else partial, details={
            "calls": app.calls_made, "errors": app.error_count, "error_messages": errors,
            "matched": round(matched, 4), "extra": extra, "exact": exact,
        })
