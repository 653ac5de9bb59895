"""A simulated scene-building application driven through a JSON API (the `tools` domain).

State: named objects (kind, position `at` = [x, y, z], size, material) and named groups
(members: objects or other groups; an item may sit in several groups). Objects and groups
share one namespace.

A call is {"call": NAME, "args": {...}} (see `api_doc()` for the calls and their args).
`SceneApp.call` never raises: it returns {"ok": true} ({"ok": true, "state": {...}} for
`query`) or {"ok": false, "error": str}; a failed call is recorded in `errors` and leaves
the state unchanged. Hard limits bound what hostile input can make the app do: calls per
session (`max_calls`, at most MAX_CALLS_CAP), items (MAX_ITEMS), name length, coordinate
and size bounds, finite numbers only, group nesting depth (MAX_GROUP_DEPTH).

Canonical scene (`SceneApp.scene()`), shared by generator and verifier:
    {"objects": {name: {"kind": str, "at": [x, y, z], "size": number, "material": str}},
     "groups": {name: [member names, sorted]}}
with numbers rounded to 6 decimals and integral values written as ints.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("cube", "sphere", "cylinder", "cone", "plane")
DEFAULT_MATERIAL = "grey"
MAX_CALLS_CAP = 256
MAX_ITEMS = 64
MAX_NAME_CHARS = 24
COORD_LIMIT = 1000.0
SIZE_LIMIT = 100.0
MAX_GROUP_DEPTH = 4
MAX_ERRORS_KEPT = 16

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ARGS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # call -> (required args, optional args)
    "create": (frozenset({"name", "kind"}), frozenset({"at", "size", "material"})),
    "move": (frozenset({"name"}), frozenset({"to", "by"})),
    "group": (frozenset({"name", "members"}), frozenset()),
    "set_material": (frozenset({"name", "material"}), frozenset()),
    "delete": (frozenset({"name"}), frozenset()),
    "query": (frozenset({"name"}), frozenset()),
}

Vec = tuple[float, float, float]
Number = int | float


def api_doc() -> str:
    """The API as it is shown to the model (about 500 characters)."""
    return (
        'Scene API. A call is {"call": NAME, "args": {...}}; positions are [x,y,z].\n'
        f"create: name, kind ({'|'.join(KINDS)}), at=[0,0,0], size=1, "
        f'material="{DEFAULT_MATERIAL}"\n'
        "move: name, to=[x,y,z] or by=[dx,dy,dz]; a group moves all its members "
        "(to: their mean position goes there)\n"
        "group: name, members=[names]; an existing group gets them added\n"
        "set_material: name, material (a group: all its members)\n"
        "delete: name (a group: the group only, members stay)\n"
        "query: name -> its state\n"
        "A failed call changes nothing."
    )


class CallError(Exception):
    """A call the app refuses; the message says why."""


@dataclass
class SceneObject:
    kind: str
    at: Vec
    size: float
    material: str


def _show(value: object) -> str:
    """A short rendering of a (possibly huge or hostile) value for an error message."""
    if isinstance(value, str):
        return repr(value[:MAX_NAME_CHARS]) + ("..." if len(value) > MAX_NAME_CHARS else "")
    return f"a {type(value).__name__}"


def check_name(value: object, field: str) -> str:
    if (not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS
            or not _NAME.fullmatch(value)):
        raise CallError(f"{field} must be a name (letters, digits, _; at most "
                        f"{MAX_NAME_CHARS} characters), got {_show(value)}")
    return value


def check_number(value: object, field: str, limit: float) -> float:
    """A finite JSON number (not a bool) within [-limit, limit], as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CallError(f"{field} must be a number, got {_show(value)}")
    if not -limit <= value <= limit:  # compares big ints exactly; NaN fails too
        raise CallError(f"{field} must be a finite number within +-{limit:g}")
    return float(value)


def check_vector(value: object, field: str, limit: float = COORD_LIMIT) -> Vec:
    if not isinstance(value, list) or len(value) != 3:
        raise CallError(f"{field} must be [x, y, z], got {_show(value)}")
    x, y, z = (check_number(v, f"{field}[{i}]", limit) for i, v in enumerate(value))
    return (x, y, z)


def canonical_number(value: float) -> Number:
    rounded = round(value, 6) + 0.0  # + 0.0 turns -0.0 into 0.0
    return int(rounded) if rounded.is_integer() else rounded


def canonical_json(scene: Mapping[str, Any]) -> str:
    """One string per scene: sorted keys, no spaces."""
    return json.dumps(scene, sort_keys=True, separators=(",", ":"))


class SceneApp:
    """One session of the application; not shared between threads."""

    def __init__(self, max_calls: int = 32) -> None:
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or not (
                1 <= max_calls <= MAX_CALLS_CAP):
            raise ValueError(f"max_calls must be an int in [1, {MAX_CALLS_CAP}]")
        self.max_calls = max_calls
        self.objects: dict[str, SceneObject] = {}
        self.groups: dict[str, list[str]] = {}
        self.calls_made = 0
        self.error_count = 0
        self.errors: list[str] = []  # the first MAX_ERRORS_KEPT messages
        self._handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "create": self._create, "move": self._move, "group": self._group,
            "set_material": self._set_material, "delete": self._delete,
            "query": self._query,
        }

    def run(self, calls: Sequence[object]) -> list[dict[str, Any]]:
        """Every call in order, up to the call limit; the rest are one recorded error."""
        room = self.max_calls - self.calls_made
        results = [self.call(request) for request in calls[:max(room, 0)]]
        if len(calls) > room:
            self._record(f"call limit {self.max_calls}: {len(calls) - max(room, 0)} "
                         "calls not run")
        return results

    def call(self, request: object) -> dict[str, Any]:
        if self.calls_made >= self.max_calls:
            return self._fail(f"call limit {self.max_calls} reached")
        self.calls_made += 1
        try:
            name, args = self._shape(request)
            return self._handlers[name](args)
        except CallError as err:
            return self._fail(f"call {self.calls_made}: {err}")

    def _record(self, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(message)

    def _fail(self, message: str) -> dict[str, Any]:
        self._record(message)
        return {"ok": False, "error": message}

    @staticmethod
    def _shape(request: object) -> tuple[str, dict[str, Any]]:
        if not isinstance(request, dict) or set(request) != {"call", "args"}:
            raise CallError('a call is {"call": NAME, "args": {...}}')
        name, args = request["call"], request["args"]
        if not isinstance(name, str) or name not in _ARGS:
            raise CallError(f"unknown call {_show(name)}; calls: {', '.join(_ARGS)}")
        if not isinstance(args, dict):
            raise CallError(f"{name}: args must be an object")
        required, optional = _ARGS[name]
        missing = required - set(args)
        unknown = set(args) - required - optional
        if missing or unknown:
            raise CallError(f"{name}: missing args {sorted(missing)}, unknown args "
                            f"{sorted(_show(k) for k in unknown)}")
        return name, args

    def _item(self, args: Mapping[str, Any]) -> str:
        name = check_name(args["name"], "name")
        if name not in self.objects and name not in self.groups:
            raise CallError(f"no object or group named {name!r}")
        return name

    def _create(self, args: dict[str, Any]) -> dict[str, Any]:
        name = check_name(args["name"], "name")
        kind = args["kind"]
        if kind not in KINDS:
            raise CallError(f"kind must be one of {', '.join(KINDS)}, got {_show(kind)}")
        at = check_vector(args.get("at", [0, 0, 0]), "at")
        size = check_number(args.get("size", 1), "size", SIZE_LIMIT)
        if size <= 0:
            raise CallError("size must be > 0")
        material = check_name(args.get("material", DEFAULT_MATERIAL), "material")
        if name in self.objects or name in self.groups:
            raise CallError(f"{name!r} already exists")
        if len(self.objects) + len(self.groups) >= MAX_ITEMS:
            raise CallError(f"the scene is full ({MAX_ITEMS} objects and groups)")
        self.objects[name] = SceneObject(kind, at, size, material)
        return {"ok": True}

    def _move(self, args: dict[str, Any]) -> dict[str, Any]:
        name = self._item(args)
        if ("to" in args) == ("by" in args):
            raise CallError("move takes exactly one of to=[x,y,z] or by=[dx,dy,dz]")
        targets = self.objects_under(name)
        if "by" in args:
            offset = check_vector(args["by"], "by", 2 * COORD_LIMIT)
        else:
            goal = check_vector(args["to"], "to")
            if not targets:
                raise CallError(f"group {name!r} has no objects to move")
            centre = self.position(name)
            offset = (goal[0] - centre[0], goal[1] - centre[1], goal[2] - centre[2])
        moved = {t: _shifted(self.objects[t].at, offset) for t in targets}
        if any(abs(c) > COORD_LIMIT for at in moved.values() for c in at):
            raise CallError(f"the move takes {name!r} past +-{COORD_LIMIT:g}")
        for target, at in moved.items():
            self.objects[target].at = at
        return {"ok": True}

    def _group(self, args: dict[str, Any]) -> dict[str, Any]:
        name = check_name(args["name"], "name")
        members = args["members"]
        if not isinstance(members, list) or len(members) > MAX_ITEMS:
            raise CallError(f"members must be a list of at most {MAX_ITEMS} names")
        for i, member in enumerate(members):
            check_name(member, f"members[{i}]")
            if member not in self.objects and member not in self.groups:
                raise CallError(f"no object or group named {member!r}")
        if len(set(members)) != len(members):
            raise CallError("members repeat a name")
        if name in self.objects:
            raise CallError(f"{name!r} is an object, not a group")
        current = self.groups.get(name, [])
        if name not in self.groups and len(self.objects) + len(self.groups) >= MAX_ITEMS:
            raise CallError(f"the scene is full ({MAX_ITEMS} objects and groups)")
        if already := [m for m in members if m in current]:
            raise CallError(f"{already[0]!r} is already in {name!r}")
        if any(m == name or name in self._groups_under(m) for m in members):
            raise CallError(f"a group cannot contain itself ({name!r})")
        tentative = {**self.groups, name: current + members}
        if _depth(tentative) > MAX_GROUP_DEPTH:
            raise CallError(f"groups nest at most {MAX_GROUP_DEPTH} deep")
        self.groups[name] = current + members
        return {"ok": True}

    def _set_material(self, args: dict[str, Any]) -> dict[str, Any]:
        name = self._item(args)
        material = check_name(args["material"], "material")
        for target in self.objects_under(name):
            self.objects[target].material = material
        return {"ok": True}

    def _delete(self, args: dict[str, Any]) -> dict[str, Any]:
        name = self._item(args)
        self.objects.pop(name, None)
        self.groups.pop(name, None)
        for members in self.groups.values():
            if name in members:
                members.remove(name)
        return {"ok": True}

    def _query(self, args: dict[str, Any]) -> dict[str, Any]:
        name = self._item(args)
        if name in self.objects:
            state = _object_json(self.objects[name])
            state["groups"] = sorted(g for g, ms in self.groups.items() if name in ms)
        else:
            at = self.position(name) if self.objects_under(name) else None
            state = {"members": list(self.groups[name]),
                     "at": None if at is None else [canonical_number(c) for c in at]}
        return {"ok": True, "state": state}

    def objects_under(self, name: str) -> list[str]:
        """The distinct objects `name` stands for: itself, or a group's objects at any
        depth, in first-seen order."""
        found: dict[str, None] = {}
        for item in [name, *self._groups_under(name)]:
            if item in self.objects:
                found[item] = None
            for member in self.groups.get(item, []):
                if member in self.objects:
                    found[member] = None
        return list(found)

    def _groups_under(self, name: str) -> list[str]:
        """The groups nested inside `name` (not `name` itself), any depth."""
        seen: dict[str, None] = {}
        stack = [m for m in self.groups.get(name, []) if m in self.groups]
        while stack:
            group = stack.pop()
            if group not in seen:
                seen[group] = None
                stack.extend(m for m in self.groups[group] if m in self.groups)
        return list(seen)

    def position(self, name: str) -> Vec:
        """An object's position, or the mean position of a group's objects."""
        points = [self.objects[t].at for t in self.objects_under(name)]
        x, y, z = (sum(p[i] for p in points) / len(points) for i in range(3))
        return (x, y, z)

    def scene(self) -> dict[str, Any]:
        """The canonical scene (module docstring)."""
        return {"objects": {n: _object_json(o) for n, o in sorted(self.objects.items())},
                "groups": {n: sorted(ms) for n, ms in sorted(self.groups.items())}}


def _shifted(at: Vec, offset: Vec) -> Vec:
    return (at[0] + offset[0], at[1] + offset[1], at[2] + offset[2])


def _object_json(obj: SceneObject) -> dict[str, Any]:
    return {"kind": obj.kind, "at": [canonical_number(c) for c in obj.at],
            "size": canonical_number(obj.size), "material": obj.material}


def _depth(groups: Mapping[str, list[str]]) -> int:
    """The deepest nesting of an acyclic group mapping (a group of objects: 1)."""
    memo: dict[str, int] = {}

    def depth(group: str) -> int:
        if group not in memo:
            memo[group] = 1 + max((depth(m) for m in groups[group] if m in groups),
                                  default=0)
        return memo[group]

    return max((depth(g) for g in groups), default=0)
