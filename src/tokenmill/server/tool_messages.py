"""The tool parts of past chat messages, checked and brought to one shape: an assistant turn's
`tool_calls`, and the `name` / `tool_call_id` / `tool_name` strings that tie a tool result to its
call.

A call is `{"function": {"name": "...", "arguments": ...}}` (OpenAI adds `id` and `type`). OpenAI
sends the arguments as JSON text, Ollama as an object; either way they come out as the object, which
is what chat templates and the default tool format write back into the prompt. Anything else is a
400 naming the part to fix, never a half-rendered prompt."""
from __future__ import annotations

import json
from typing import Any

from tokenmill.server.client_json import decode_json
from tokenmill.server.errors import bad_request

_STRING_FIELDS = ("name", "tool_call_id", "tool_name")


def check_tool_parts(message: dict, where: str, *, text_arguments: bool) -> dict:
    """`message` (a normalized copy) with its tool calls in the one shape. `text_arguments`: the
    arguments may come as JSON text (OpenAI) and not only as an object (Ollama)."""
    for key in _STRING_FIELDS:
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{where}.{key} must be a string, got {_type_name(value)}", f"{where}.{key}")
    calls = message.get("tool_calls")
    if calls is None:
        return message
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list of calls, got {_type_name(calls)}",
                          f"{where}.tool_calls")
    return {**message, "tool_calls": [_call(c, f"{where}.tool_calls[{j}]", text_arguments)
                                      for j, c in enumerate(calls)]}


def _call(call: Any, where: str, text_arguments: bool) -> dict:
    if not isinstance(call, dict):
        raise bad_request(f'{where} must be an object like {{"function": {{"name": ..., "arguments": ...}}}}, '
                          f"got {_type_name(call)}", where)
    if call.get("type") not in (None, "function"):
        raise bad_request(f'{where}.type must be "function", got {json.dumps(call["type"])[:50]}', f"{where}.type")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise bad_request(f"{where}.id must be a string, got {_type_name(call['id'])}", f"{where}.id")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function must be an object with name and arguments, got {_type_name(fn)}",
                          f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str):
        raise bad_request(f"{where}.function.name must be a string, got {_type_name(name)}", f"{where}.function.name")
    arguments = _arguments(fn.get("arguments"), f"{where}.function.arguments", text_arguments)
    return {**call, "type": "function", "function": {**fn, "name": name, "arguments": arguments}}


def _arguments(value: Any, where: str, text_arguments: bool) -> dict:
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    if not isinstance(value, str) or not text_arguments:
        wanted = "an object or its JSON text" if text_arguments else "an object"
        raise bad_request(f"{where} must be {wanted}, got {_type_name(value)}", where)
    if not value.strip():  # a call without arguments
        return {}
    parsed = decode_json(value, where)
    if not isinstance(parsed, dict):
        raise bad_request(f"{where} must hold a JSON object, got {_type_name(parsed)}", where)
    return parsed


def _type_name(value: Any) -> str:
    return {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)
