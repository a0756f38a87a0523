"""A Responses API request (POST /v1/responses) as the chat completions body it amounts to: input
items -> messages (function calls and their outputs -> assistant tool_calls and tool messages),
instructions -> a system message, text.format -> response_format, flat function tools -> chat tools;
and a 400 naming the Responses field for what it cannot take (stored state, images, built-in tools)."""
from __future__ import annotations

import re

from tokenmill.server.errors import APIError, bad_request, shown_value
from tokenmill.server.validation import get_int, joined_text, warn_unknown

# Fields taken over from the chat body as they are (the chat path checks them).
_SAME = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "seed", "user", "stop",
         "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "priority")
_HARMLESS = {"store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "truncation",
             "reasoning", "include", "stream_options", "max_tool_calls", "prompt_cache_retention"}
_REFUSED = {
    "previous_response_id": "this server keeps no responses (it is stateless, as Ollama's): send the whole "
                            "conversation as input",
    "conversation": "this server keeps no conversations: send the whole conversation as input",
    "background": "background responses are not supported (they would have to be stored)",
    "prompt": "stored prompt templates are not supported: send the text as input",
}
RESPONSES_FIELDS = {*_SAME, *_HARMLESS, *_REFUSED, "input", "instructions", "max_output_tokens", "text", "tools",
                    "tool_choice", "top_logprobs"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text_of(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text / output_text)."""
    return joined_text(content, where, _part_text, "a list of content parts")


def _part_text(part, at: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS:
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{at}: {kind} is not supported, this model accepts text only", at)
        raise bad_request(f"{at} must be a text part ({', '.join(_TEXT_PARTS[:2])}), got {shown_value(kind)}", at)
    if not isinstance(part.get("text"), str):
        raise bad_request(f"{at}.text must be a string", f"{at}.text")
    return part["text"]


def _messages(body: dict) -> list[dict]:
    """instructions and input as chat messages; function calls and their outputs as the chat API's
    assistant tool_calls and tool messages."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of input items", "input")
    reasoning = None  # a reasoning item's text, for the assistant turn it came before
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "reasoning":
            # A thinking model's reasoning, sent back: the next assistant turn's reasoning_content, which
            # thinking models' templates write back (Qwen3's, after the last user message).
            reasoning = _reasoning_text(item, where)
            continue
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer, got "
                                  f"{shown_value(role)}", f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # The text and calls of one assistant turn (a response's output items, sent back) are one
                # chat message, as the chat API has them.
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text_of(item.get("output"), f"{where}.output")})
        else:
            raise bad_request(f"{where}.type must be message, function_call, function_call_output or reasoning, "
                              f"got {shown_value(kind)}", f"{where}.type")
        if reasoning and messages[-1]["role"] == "assistant":  # the turn this item made or joined
            messages[-1]["reasoning_content"] = reasoning
        reasoning = None
    return messages


def _reasoning_text(item: dict, where: str) -> str | None:
    """A reasoning item's text: its reasoning_text content parts (what this server sends), else its summary."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == kind]
            if not all(isinstance(t, str) for t in texts):
                raise bad_request(f"{where}.{key}[].text must be a string", f"{where}.{key}")
            if texts:
                return "\n".join(texts)
    return None


def _function_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                    "arguments": item["arguments"]}}


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad_request(f"{where}.type: only function tools are supported here (no built-in tools such as "
                              f"web or file search), got {shown_value(kind)}", f"{where}.type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value):
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad_request("tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                      "tool_choice")


def _response_format(body: dict) -> dict | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {shown_value(kind)}",
                      "text.format.type")


def _check_harmless(body: dict) -> None:
    """Fields that change nothing here still have the types OpenAI requires (a 400 otherwise)."""
    metadata, include = body.get("metadata"), body.get("include")
    if metadata is not None and (not isinstance(metadata, dict)
                                 or not all(isinstance(v, str) for v in metadata.values())):
        raise bad_request("metadata must be an object of string values", "metadata")
    if include is not None and (not isinstance(include, list) or not all(isinstance(v, str) for v in include)):
        raise bad_request("include must be a list of strings", "include")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise bad_request("store must be true or false", "store")
    if body.get("reasoning") is not None and not isinstance(body["reasoning"], dict):
        raise bad_request("reasoning must be an object ({\"effort\": ...})", "reasoning")


def chat_body(body: dict) -> dict:
    """The chat completions body a Responses request amounts to (a 400 for what it cannot)."""
    warn_unknown(body, RESPONSES_FIELDS, "/v1/responses")
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise bad_request(f"{name}: {why}", name)
    _check_harmless(body)
    chat = {k: body[k] for k in _SAME if k in body}
    chat["messages"] = _messages(body)
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]  # "none": a thinking model's thinking off
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = get_int(body, "max_output_tokens", lo=1)
    top = get_int(body, "top_logprobs", lo=0, hi=20)
    if top or "message.output_text.logprobs" in (body.get("include") or []):
        chat["logprobs"], chat["top_logprobs"] = True, top or 0
    for key, value in (("tools", _tools(body)), ("tool_choice", _tool_choice(body.get("tool_choice"))),
                       ("response_format", _response_format(body))):
        if value is not None:
            chat[key] = value
    return chat


# The chat body's names for what a Responses request spells otherwise, for the errors the chat path
# raises about them.
_CHAT_NAMES = ((re.compile(r"response_format\.json_schema\b"), "text.format"),
               (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"),
               (re.compile(r"\bmessages(\[\d+\])?"), "input"),
               (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
               (re.compile(r"\breasoning_effort\b"), "reasoning.effort"))


def in_responses_terms(err: APIError) -> APIError:
    """An error the chat path raised about the translated body, naming the Responses fields instead."""
    for pattern, name in _CHAT_NAMES:
        err.message = pattern.sub(name, err.message)
        if err.param is not None:
            err.param = pattern.sub(name, err.param)
    return err
