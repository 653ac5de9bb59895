"""Tool calls in the OpenAI function-calling JSON format, and parsing them from model text.

A tool is described to the model as OpenAI's `{"type": "function", "function": {name,
description, parameters}}`, where `parameters` is a JSON schema object. The model answers
with one call wrapped in tags, the convention of Hermes/Qwen chat templates:

    <tool_call>{"name": "run", "arguments": {"command": "ls"}}</tool_call>

`arguments` may also be a JSON *string* holding the object, as in OpenAI's API responses.
Anything else (no call, bad JSON, an unknown tool, a missing or mistyped argument) is a
`ToolCallError` whose message is shown to the model as the observation: a malformed call
is the model's mistake to correct, never an exception in the scheduler.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moerl.rewards.wire import repair_text, repair_values

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)
# JSON schema type name -> the Python types json.loads produces for it. bool is an int
# subclass in Python, so it is excluded from "integer" and "number" explicitly below.
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}
_MAX_ECHO = 200


@dataclass(frozen=True)
class ToolSpec:
    """One tool: `parameters` maps argument name -> JSON schema (`type`, `description`)."""

    name: str
    description: str
    parameters: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    required: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        missing = set(self.required) - set(self.parameters)
        if missing:
            raise ValueError(f"tool {self.name!r}: required {sorted(missing)} not in parameters")
        for arg, schema in self.parameters.items():
            if schema.get("type") not in _JSON_TYPES:
                raise ValueError(f"tool {self.name!r}: argument {arg!r} has no known JSON type")

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {k: dict(v) for k, v in self.parameters.items()},
                    "required": list(self.required),
                },
            },
        }


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]

    def to_text(self) -> str:
        """How a model should write this call (used by scripted policies and prompts)."""
        payload = json.dumps({"name": self.name, "arguments": dict(self.arguments)})
        return f"{CALL_OPEN}{payload}{CALL_CLOSE}"


@dataclass(frozen=True)
class ToolCallError:
    """Why the model's text is not a valid call; `message` is written for the model."""

    message: str


def tools_prompt(tools: Sequence[ToolSpec]) -> str:
    """The instructions that tell the model which tools exist and how to call one."""
    schemas = "\n".join(json.dumps(t.to_openai()) for t in tools)
    return (
        "You can call these tools (OpenAI function-calling schemas):\n"
        f"{schemas}\n"
        "Call exactly one tool per reply, as a JSON object inside tags:\n"
        f'{CALL_OPEN}{{"name": "<tool name>", "arguments": {{...}}}}{CALL_CLOSE}\n'
        "The result comes back inside <tool_response> tags.\n"
    )


def _echo(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _MAX_ECHO else text[:_MAX_ECHO] + "..."


def _check_arguments(tool: ToolSpec, arguments: Mapping[str, Any]) -> str | None:
    unknown = sorted(set(arguments) - set(tool.parameters))
    if unknown:
        return (
            f"tool {tool.name!r} has no argument(s) {unknown}; it takes {sorted(tool.parameters)}"
        )
    missing = [a for a in tool.required if a not in arguments]
    if missing:
        return f"tool {tool.name!r} is missing required argument(s) {missing}"
    for name, value in arguments.items():
        kind = tool.parameters[name]["type"]
        ok = isinstance(value, _JSON_TYPES[kind])
        if kind in ("integer", "number") and isinstance(value, bool):
            ok = False
        if not ok:
            return (f"argument {name!r} of tool {tool.name!r} must be a JSON {kind}, "
                    f"got {type(value).__name__} {_echo(json.dumps(value))}")  # fmt: skip
    return None


def parse_tool_call(text: str, tools: Sequence[ToolSpec]) -> ToolCall | ToolCallError:
    """The first tool call in `text`, validated against `tools`.

    A missing closing tag is accepted (generation may stop on the closing tag, which some
    engines cut from the text); what matters is that the JSON inside is complete.
    """
    by_name = {t.name: t for t in tools}
    # Model text: a byte-level decode can leave lone surrogates, raw or JSON-escaped
    # ("\\udc80"); no environment gets one in a command, a path or a file's text.
    text, _ = repair_text(text)
    match = _CALL_RE.search(text)
    if match is None:
        return ToolCallError(
            f'no tool call found. Reply with {CALL_OPEN}{{"name": ..., "arguments": '
            f"{{...}}}}{CALL_CLOSE}; tools: {sorted(by_name)}"
        )
    body = match.group(1).strip()
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCallError(f"the tool call is not valid JSON ({exc.msg} at char {exc.pos}): "
                             f"{_echo(body)}")  # fmt: skip
    if not isinstance(payload, dict):
        return ToolCallError(f"the tool call must be a JSON object, got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str):
        return ToolCallError('the tool call needs a string "name"')
    if name not in by_name:
        return ToolCallError(f"unknown tool {_echo(name)!r}; tools: {sorted(by_name)}")
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON-encoded string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCallError(f'"arguments" is a string but not valid JSON ({exc.msg})')
    if not isinstance(arguments, dict):
        return ToolCallError(f'"arguments" must be a JSON object, got {type(arguments).__name__}')
    try:
        arguments, _ = repair_values(arguments)
    except ValueError as exc:
        return ToolCallError(f'"arguments" {exc}')
    problem = _check_arguments(by_name[name], arguments)
    if problem is not None:
        return ToolCallError(problem)
    return ToolCall(name, arguments)
