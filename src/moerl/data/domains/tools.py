"""The `tools` domain: build a described scene by driving the scene app's JSON API.

Each task lists, in numbered steps, objects to create (kind, material, size, a position
given directly or relative to an earlier object, which the model has to add up), and
with groups on, a group, a move of the group by an offset and sometimes a repaint of it
(groups off or one object: often a move of one object to a point); sometimes a delete.
The steps come from a hidden reference call sequence run on a fresh `SceneApp`; the
final scene it leaves is the target.

Record: prompt = `api_doc()` + the steps + the answer format; reward "scene"
(`moerl.rewards.tools.SceneReward`); spec = {"target": canonical scene (see
`scene_app`), "max_calls": int}; reference = the reference calls as
`<calls>[{"call": ..., "args": {...}}, ...]</calls>` (compact JSON).

Options (`generate(..., options)`):
    objects: int or [min, max] objects created per task, within [1, 8]; default [2, 3]
    with_groups: bool, default true
    max_calls: int, the calls an answer may make, within [max objects + 4, 256];
        default 32

With default options a prompt is 730-840 characters (mean about 780, of which the API
text is 501) and a reference 270-540 characters (mean about 390), measured over 1000
tasks; each object more adds about 50 characters to the prompt and 90 to the reference.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moerl.data.domains.scene_app import (
    DEFAULT_MATERIAL,
    KINDS,
    MAX_CALLS_CAP,
    SceneApp,
    api_doc,
)
from moerl.data.prompts import PromptRecord

REWARD = "scene"
MAX_TASK_OBJECTS = 8
EXTRA_CALLS = 4  # group, move, repaint, delete: calls beyond one create per object
# Neutral names, so that a name never suggests a kind other than the object's.
OBJECT_NAMES = ("ant", "bee", "cat", "dog", "elk", "fox", "gnu", "hen", "owl", "yak")
GROUP_NAMES = ("zoo", "herd", "pack", "team")
MATERIALS = (DEFAULT_MATERIAL, "red", "blue", "green", "gold", "white", "black", "wood")

Call = dict[str, Any]


@dataclass(frozen=True)
class ToolsOptions:
    min_objects: int = 2
    max_objects: int = 3
    with_groups: bool = True
    max_calls: int = 32


def _int_option(value: object, field: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"options.{field}: must be an int within [{low}, {high}], "
                         f"got {value!r}")
    return value


def parse_options(options: Mapping[str, Any]) -> ToolsOptions:
    """The domain's options, checked; ValueError naming `options.<field>` and the fix."""
    known = ("objects", "with_groups", "max_calls")
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        raise ValueError(f"options.{unknown[0]}: unknown option; the tools domain takes "
                         f"{', '.join(known)}")
    objects = options.get("objects", [ToolsOptions.min_objects, ToolsOptions.max_objects])
    if isinstance(objects, int) and not isinstance(objects, bool):
        objects = [objects, objects]
    if not isinstance(objects, list | tuple) or len(objects) != 2:
        raise ValueError(f"options.objects: an int or [min, max] within [1, "
                         f"{MAX_TASK_OBJECTS}], e.g. [2, 3]; got {objects!r}")
    low = _int_option(objects[0], "objects", 1, MAX_TASK_OBJECTS)
    high = _int_option(objects[1], "objects", low, MAX_TASK_OBJECTS)
    with_groups = options.get("with_groups", True)
    if not isinstance(with_groups, bool):
        raise ValueError(f"options.with_groups: must be true or false, got {with_groups!r}")
    max_calls = _int_option(options.get("max_calls", ToolsOptions.max_calls), "max_calls",
                            high + EXTRA_CALLS, MAX_CALLS_CAP)
    return ToolsOptions(low, high, with_groups, max_calls)


def _point(values: tuple[int, ...]) -> str:
    return f"({', '.join(str(v) for v in values)})"


def _offset(rng: random.Random, span: int) -> tuple[int, int, int]:
    while True:
        x, y, z = (rng.randint(-span, span) for _ in range(3))
        if (x, y, z) != (0, 0, 0):
            return (x, y, z)


def make_task(rng: random.Random, opts: ToolsOptions) -> tuple[list[str], list[Call]]:
    """(the task's numbered steps in words, the reference calls)."""
    names = rng.sample(OBJECT_NAMES, rng.randint(opts.min_objects, opts.max_objects))
    steps: list[str] = []
    calls: list[Call] = []
    placed: dict[str, tuple[int, int, int]] = {}
    for i, name in enumerate(names):
        kind, material, size = rng.choice(KINDS), rng.choice(MATERIALS), rng.choice((1, 1, 2, 3))
        if i > 0 and rng.random() < 0.4:
            base = rng.choice(names[:i])
            offset = _offset(rng, 3)
            at = (placed[base][0] + offset[0], placed[base][1] + offset[1],
                  placed[base][2] + offset[2])
            where = f"{base} + {_point(offset)}"
        else:
            at = (rng.randint(-5, 5), rng.randint(-5, 5), rng.randint(0, 5))
            where = _point(at)
        placed[name] = at
        args: dict[str, Any] = {"name": name, "kind": kind, "at": list(at)}
        if size != 1:
            args["size"] = size
        if material != DEFAULT_MATERIAL:
            args["material"] = material
        calls.append({"call": "create", "args": args})
        steps.append(f"{name}: {material} {kind}, size {size}, at {where}")
    if opts.with_groups and len(names) >= 2:
        group = rng.choice(GROUP_NAMES)
        chosen = set(rng.sample(names, rng.randint(2, len(names))))
        members = [n for n in names if n in chosen]
        offset = _offset(rng, 4)
        calls.append({"call": "group", "args": {"name": group, "members": members}})
        calls.append({"call": "move", "args": {"name": group, "by": list(offset)}})
        steps.append(f"group {group}: {', '.join(members)}")
        steps.append(f"move {group} by {_point(offset)}")
        if rng.random() < 0.3:
            material = rng.choice([m for m in MATERIALS if m != DEFAULT_MATERIAL])
            calls.append({"call": "set_material", "args": {"name": group,
                                                           "material": material}})
            steps.append(f"paint {group} {material}")
    elif len(names) >= 2 or rng.random() < 0.5:
        name = rng.choice(names)
        goal = (rng.randint(-5, 5), rng.randint(-5, 5), rng.randint(0, 5))
        calls.append({"call": "move", "args": {"name": name, "to": list(goal)}})
        steps.append(f"move {name} to {_point(goal)}")
    if len(names) >= 2 and rng.random() < 0.3:
        victim = rng.choice(names)
        calls.append({"call": "delete", "args": {"name": victim}})
        steps.append(f"delete {victim}")
    return steps, calls


def format_calls(calls: list[Call]) -> str:
    """The answer format: a compact JSON array of calls inside <calls>...</calls>."""
    return f"<calls>{json.dumps(calls, separators=(',', ':'))}</calls>"


def render_prompt(steps: list[str], max_calls: int) -> str:
    numbered = "\n".join(f"{i}. {step}" for i, step in enumerate(steps, start=1))
    return (f"{api_doc()}\n\nBuild this scene, in order:\n{numbered}\n\n"
            f"Answer with a JSON array of at most {max_calls} calls inside "
            "<calls>...</calls>.")


def generate(count: int, seed: int, split: str,
             options: Mapping[str, Any]) -> list[PromptRecord]:
    """`count` tasks for `seed` and `split` ("train" or "eval"); uids
    "{split}-tools-{seed}-{index}"; identical for identical arguments."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    opts = parse_options(options)
    records = []
    for index in range(count):
        rng = random.Random(f"tools:{split}:{seed}:{index}")
        steps, calls = make_task(rng, opts)
        app = SceneApp(opts.max_calls)
        app.run(calls)
        if app.error_count:  # a generator bug, never a property of the task
            raise RuntimeError(f"tools reference failed: {app.errors}")
        records.append(PromptRecord(
            uid=f"{split}-tools-{seed}-{index}",
            prompt=render_prompt(steps, opts.max_calls),
            reward=REWARD,
            spec={"target": app.scene(), "max_calls": opts.max_calls},
            reference=format_calls(calls),
        ))
    return records
