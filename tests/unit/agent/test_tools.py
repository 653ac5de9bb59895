"""Tool-call parsing: valid calls in both argument spellings, and every malformed shape
turns into a message for the model instead of an exception."""

import json

import pytest

from moerl.agent.terminal import TOOLS
from moerl.agent.tools import ToolCall, ToolCallError, ToolSpec, parse_tool_call, tools_prompt


def test_valid_call_and_round_trip() -> None:
    call = ToolCall("run", {"command": "ls -la", "timeout_s": 2.5})
    assert parse_tool_call("I will list.\n" + call.to_text() + " trailing", TOOLS) == call


def test_openai_string_arguments_and_missing_close_tag() -> None:
    arguments = json.dumps({"path": "a", "content": "b"})  # a JSON string, as OpenAI sends
    text = "<tool_call>" + json.dumps({"name": "write_file", "arguments": arguments})
    assert parse_tool_call(text, TOOLS) == ToolCall("write_file", {"path": "a", "content": "b"})
    assert parse_tool_call('<tool_call>{"name": "submit"}', TOOLS) == ToolCall("submit", {})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("just prose, no call", "no tool call found"),
        ('<tool_call>{"name": "run", "arguments": {"command": "ls"</tool_call>', "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a string "name"'),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool 'rm_rf'"),
        ('<tool_call>{"name": "run", "arguments": {}}</tool_call>', "missing required argument"),
        (
            '<tool_call>{"name": "run", "arguments": {"command": 3}}</tool_call>',
            "must be a JSON string",
        ),
        (
            '<tool_call>{"name": "run", "arguments": {"command": "ls", "timeout_s": true}}'
            "</tool_call>",
            "must be a JSON number",
        ),
        (
            '<tool_call>{"name": "run", "arguments": {"command": "ls", "sudo": 1}}</tool_call>',
            "has no argument(s) ['sudo']",
        ),
        ('<tool_call>{"name": "run", "arguments": "{oops"}</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "run", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ("<tool_call>\x00\xff garbage \ufffd</tool_call>", "not valid JSON"),
    ],
)
def test_malformed_calls_become_messages(text: str, message: str) -> None:
    result = parse_tool_call(text, TOOLS)
    assert isinstance(result, ToolCallError)
    assert message in result.message


def test_schemas_are_openai_function_format() -> None:
    schema = TOOLS[0].to_openai()
    assert schema["type"] == "function"
    assert schema["function"]["parameters"]["required"] == ["command"]
    assert schema["function"]["parameters"]["properties"]["command"]["type"] == "string"
    prompt = tools_prompt(TOOLS)
    assert all(json.dumps(t.to_openai()) in prompt for t in TOOLS)
    with pytest.raises(ValueError, match="required"):
        ToolSpec("bad", "x", {}, required=("a",))


@pytest.mark.parametrize("surrogate", ["\udc80", "\\udc80"])  # raw, and JSON-escaped
def test_lone_surrogates_in_a_call_are_repaired(surrogate: str) -> None:
    """A byte-level decode of the model's tokens can hold lone surrogates; the parsed call
    carries U+FFFD instead, so no environment (a server's or the trainer's own terminal)
    fails to write or run it."""
    text = ('<tool_call>{"name": "write_file", "arguments": {"path": "a' + surrogate
            + '.txt", "content": "x' + surrogate + 'y"}}</tool_call>')
    call = parse_tool_call(text, TOOLS)
    assert call == ToolCall("write_file", {"path": "a\ufffd.txt", "content": "x\ufffdy"})
    json.dumps(call.arguments).encode("utf-8")  # encodable, the surrogate gone


def test_arguments_nested_too_deep_are_a_message() -> None:
    deep = '{"a": ' * 70 + "1" + "}" * 70
    text = '<tool_call>{"name": "run", "arguments": {"command": "ls", "x": ' + deep + "}}"
    result = parse_tool_call(text + "</tool_call>", TOOLS)
    assert isinstance(result, ToolCallError) and "nests deeper" in result.message
