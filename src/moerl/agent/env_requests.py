"""The environment server's inputs and replies, checked per session (the rules for each
kind of value are in `moerl.rewards.wire`).

A task is reference data: a field of the wrong type, an unknown key or a string that
is not valid Unicode refuses the reset (HTTP 422, naming the field) instead of
crashing the environment deep inside a write. A tool call is the model's: its text is
repaired (a lone surrogate becomes U+FFFD) and it is checked against the session's
tools as the scheduler checks model text, so a malformed call comes back to the model
as an observation with `error`, never as a crash of the environment. Replies are made
JSON-safe, so an environment's odd output cannot fail the response.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from moerl.agent.environment import AgentTask, Observation
from moerl.agent.tools import ToolCall, ToolCallError, ToolSpec, parse_tool_call
from moerl.rewards import wire

_TASK_FIELDS = {f.name for f in dataclasses.fields(AgentTask)}
_TEXT_FIELDS = ("id", "instruction", "check", "setup")


class TaskBody(BaseModel):
    task: dict[str, Any]


class CallBody(BaseModel):
    call: dict[str, Any]


class BadRequest(ValueError):
    """The request itself is malformed; the message names the field."""


def parse_task(body: Any) -> AgentTask:
    """The AgentTask of a reset's `task`; BadRequest naming the field otherwise."""
    if not isinstance(body, dict):
        raise BadRequest(f"task must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _TASK_FIELDS)
    if unknown:
        raise BadRequest(f"task has unknown field(s) {unknown}; known: {sorted(_TASK_FIELDS)}")
    for name in ("id", "instruction"):
        if name not in body:
            raise BadRequest(f"task.{name} is missing")
    for name in _TEXT_FIELDS:
        if name in body and not isinstance(body[name], str):
            raise BadRequest(f"task.{name} must be a string, got {type(body[name]).__name__}")
    files = body.get("files") or {}
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise BadRequest("task.files must be an object of file name -> text")
    max_turns = body.get("max_turns")
    if max_turns is not None and (type(max_turns) is not int or max_turns < 1):
        raise BadRequest(f"task.max_turns must be a positive integer or null, got {max_turns!r}")
    why = wire.invalid_value(body, "task")
    if why is not None:
        raise BadRequest(why)
    return AgentTask(id=body["id"], instruction=body["instruction"], files=dict(files),
                     check=body.get("check", ""), max_turns=max_turns,
                     setup=body.get("setup", ""))  # fmt: skip


def parse_call(body: Any, tools: Sequence[ToolSpec]) -> ToolCall | Observation:
    """The validated ToolCall of a step's `call`, its strings repaired; or, for a call
    that does not fit the session's tools, the observation telling the model why."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return Observation('the tool call needs a string "name"', error=True)
    arguments = body.get("arguments") or {}
    if not isinstance(arguments, dict):
        return Observation(f'"arguments" must be a JSON object, got {type(arguments).__name__}',
                           error=True)  # fmt: skip
    try:
        name, _ = wire.repair_text(body["name"])
        arguments, _ = wire.repair_values(arguments)
    except ValueError as exc:
        return Observation(f"the call's arguments are refused: their value {exc}", error=True)
    # The same check the scheduler applies to the model's text, for calls sent directly.
    checked = parse_tool_call(ToolCall(name, arguments).to_text(), tools)
    if isinstance(checked, ToolCallError):
        return Observation(checked.message, error=True)
    return checked


def reply(data: Any) -> JSONResponse:
    """`data` as a JSON response that encodes whatever text it holds."""
    return JSONResponse(wire.json_safe(data)[0])


def refuse(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": wire.json_safe(message)[0],
                                   "type": "invalid"}}, 422)  # fmt: skip
