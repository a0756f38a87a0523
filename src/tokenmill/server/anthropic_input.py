"""An Anthropic Messages request (POST /v1/messages) as the chat completions body it amounts to:
`system` -> a system message, content blocks -> chat messages (tool_use blocks -> an assistant's
tool_calls, tool_result blocks -> tool messages), a final assistant message -> a prefill the model
continues (as Anthropic does), custom tools -> function tools, tool_choice any/tool -> required/a
named function, stop_sequences -> stop; and a 400 naming the Messages field for what it cannot take
(images, server tools, MCP servers)."""
from __future__ import annotations

import json
import re

from tokenmill.server.errors import APIError, bad_request, shown_value
from tokenmill.server.validation import get_int, joined_text, warn_unknown

# Fields taken over from the chat body as they are (the chat path checks them); past Anthropic's own
# (temperature, top_p, top_k, stream), the sampling extensions the other APIs here take (vLLM's
# ignore_eos and min_tokens among them, which benchmarks use to fix the output's length).
_SAME = ("model", "temperature", "top_p", "top_k", "stream", "seed", "min_p", "repetition_penalty",
         "presence_penalty", "frequency_penalty", "priority", "ignore_eos", "min_tokens")
# Fields that change nothing here: billing, routing and caching hints (the prefix cache is automatic).
_HARMLESS = {"metadata", "service_tier", "thinking", "cache_control", "diagnostics", "inference_geo", "speed",
             "user_profile_id", "workspace_id"}
_REFUSED = {
    "mcp_servers": "MCP server connectors are not supported: run the tools in the client and send their results",
    "container": "code execution containers are not supported",
}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", *_REFUSED}
MESSAGES_FIELDS = {*_SAME, *_HARMLESS, *_REFUSED, "messages", "system", "max_tokens", "stop_sequences", "tools",
                   "tool_choice", "output_config", "output_format"}
_THINKING_TYPES = ("enabled", "disabled", "adaptive")


def _text_blocks(content, where: str) -> str:
    """Text given as a string or a list of text blocks (system, tool_result content)."""
    return joined_text(content, where, _block_text, "a list of text blocks")


def _block_text(block, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise bad_request(f"{where}.text must be a string", f"{where}.text")
        return block["text"]
    if kind == "document":
        source = block.get("source")
        if isinstance(source, dict) and source.get("type") == "text" and isinstance(source.get("data"), str):
            return source["data"]  # a plain-text document is text; PDFs and URLs need what this server lacks
        raise bad_request(f"{where}: only plain-text documents (source type text) are supported", where)
    if kind in ("image", "search_result"):
        raise bad_request(f"{where}: {kind} blocks are not supported, this model accepts text only", where)
    raise bad_request(f"{where} must be a text block, got {shown_value(kind)}", f"{where}.type")


class _Conversation:
    """Chat messages built from the Messages request, each with the Messages location it came from
    (`origins`), so an error the chat path raises about `messages[k]` can name what the client sent."""

    def __init__(self):
        self.messages: list[dict] = []
        self.origins: list[str] = []

    def add(self, message: dict, origin: str) -> dict:
        self.messages.append(message)
        self.origins.append(origin)
        return message

    def user(self, content, where: str) -> None:
        if isinstance(content, str):
            self.add({"role": "user", "content": content}, where)
            return
        text: dict | None = None  # the user message the text blocks in a row go into
        for i, block in enumerate(content):
            at = f"{where}[{i}]"
            if isinstance(block, dict) and block.get("type") == "tool_result":
                self.add(_tool_result(block, at), at)
                text = None
            elif not (isinstance(block, dict) and block.get("type") in ("thinking", "redacted_thinking")):
                piece = _block_text(block, at)
                if text is None:
                    text = self.add({"role": "user", "content": ""}, at)
                text["content"] += piece

    def assistant(self, content, where: str) -> None:
        if isinstance(content, str):
            self.add({"role": "assistant", "content": content}, where)
            return
        message = self.add({"role": "assistant", "content": ""}, where)
        for i, block in enumerate(content):
            at = f"{where}[{i}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_use":
                message.setdefault("tool_calls", []).append(_tool_call(block, at))
            elif kind == "thinking":  # a thinking model's reasoning: the template may write it back (Qwen3's)
                if not isinstance(block.get("thinking"), str):
                    raise bad_request(f"{at}.thinking must be a string", f"{at}.thinking")
                message["reasoning_content"] = message.get("reasoning_content", "") + block["thinking"]
            elif kind != "redacted_thinking":  # encrypted reasoning of Anthropic's models: nothing to render
                message["content"] += _block_text(block, at)


def _tool_call(block: dict, where: str) -> dict:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise bad_request(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    if not isinstance(block.get("input"), dict):
        raise bad_request(f"{where}.input must be an object", f"{where}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tool_result(block: dict, where: str) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}.tool_use_id must be a non-empty string", f"{where}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else _text_blocks(content, f"{where}.content")
    if block.get("is_error") is True:
        text = f"Error: {text}"  # the template has no field for it: the model reads it in the text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _messages(body: dict) -> tuple[list[dict], list[str], bool]:
    """The chat messages, where each came from, and whether the last (assistant) one is a prefill."""
    conv = _Conversation()
    system = body.get("system")
    if system is not None:
        conv.add({"role": "system", "content": _text_blocks(system, "system")}, "system")
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    for i, m in enumerate(items):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        role, content = m.get("role"), m.get("content")
        if role == "system":
            raise bad_request(f"{where}.role: system text goes in the top-level `system` field", f"{where}.role")
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant, got {shown_value(role)}", f"{where}.role")
        if not isinstance(content, (str, list)) or content == []:
            raise bad_request(f"{where}.content must be a string or a non-empty list of content blocks",
                              f"{where}.content")
        (conv.user if role == "user" else conv.assistant)(content, f"{where}.content")
    if not conv.messages:  # thinking blocks alone: nothing a template renders
        raise bad_request("messages hold no text, tool_use or tool_result blocks", "messages")
    last = conv.messages[-1]
    prefill = last["role"] == "assistant"
    if prefill and last.get("tool_calls"):
        raise bad_request("the last message is an assistant's tool_use: send its tool_result in a user message "
                          "after it", f"messages[{len(items) - 1}]")
    return conv.messages, conv.origins, prefill


def _tools(value) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, t in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{where} must be an object", where)
        if t.get("type") not in (None, "custom"):
            raise bad_request(f"{where}.type: only custom tools (name, description, input_schema) are supported "
                              f"here, not server tools; got {shown_value(t.get('type'))}", f"{where}.type")
        fn = {"name": t.get("name"), "parameters": t.get("input_schema")}
        fn.update({k: t[k] for k in ("description", "strict") if t.get(k) is not None})
        if fn["parameters"] is None:
            raise bad_request(f"{where}.input_schema is required", f"{where}.input_schema")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value) -> tuple[object, bool | None]:
    """The chat tool_choice, and parallel_tool_calls (False when parallel use is disabled)."""
    if value is None:
        return None, None
    kind = value.get("type") if isinstance(value, dict) else None
    choices = {"auto": "auto", "any": "required", "none": "none"}
    if kind in choices:
        choice = choices[kind]
    elif kind == "tool" and isinstance(value.get("name"), str):
        choice = {"type": "function", "function": {"name": value["name"]}}
    else:
        raise bad_request('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                          '{"type": "tool", "name": ...}', "tool_choice")
    disable = value.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use must be true or false",
                          "tool_choice.disable_parallel_tool_use")
    return choice, (False if disable else None)


def _response_format(body: dict) -> dict | None:
    """Structured outputs: output_config.format (or the older beta's output_format), a JSON schema the
    text follows, as the chat API's response_format."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_request("output_config must be an object", "output_config")
    where, fmt = "output_config.format", (config or {}).get("format")
    if fmt is None:
        where, fmt = "output_format", body.get("output_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request(f'{where} must be {{"type": "json_schema", "schema": ...}}', f"{where}.type")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request(f"{where}.schema must be a JSON schema object", f"{where}.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _check_harmless(body: dict) -> None:
    """Fields that change nothing here still have the types Anthropic requires (a 400 otherwise)."""
    metadata, thinking = body.get("metadata"), body.get("thinking")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("metadata must be an object", "metadata")
    # A model that cannot think answers a request for thinking without thinking blocks (as Ollama
    # does), so clients that always ask still work; budget_tokens is not held to.
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") not in _THINKING_TYPES):
        raise bad_request(f"thinking.type must be one of {', '.join(_THINKING_TYPES)}", "thinking.type")


def _stop_sequences(body: dict) -> list[str] | None:
    value = body.get("stop_sequences")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("stop_sequences must be a list of strings", "stop_sequences")
    return value


def chat_body(body: dict, *, count_only: bool = False) -> tuple[dict, list[str]]:
    """The chat completions body a Messages request amounts to, and where each of its messages came
    from (for in_messages_terms); count_only: /v1/messages/count_tokens's body (no max_tokens)."""
    warn_unknown(body, COUNT_FIELDS if count_only else MESSAGES_FIELDS,
                 "/v1/messages/count_tokens" if count_only else "/v1/messages")
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, [], {}):
            raise bad_request(f"{name}: {why}", name)
    _check_harmless(body)
    messages, origins, prefill = _messages(body)
    chat: dict = {k: body[k] for k in (("model",) if count_only else _SAME) if k in body}
    chat["messages"] = messages
    if prefill:  # Anthropic continues a final assistant message: the prompt ends inside it
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    if not count_only:
        if body.get("max_tokens") is None:
            raise bad_request("max_tokens is required", "max_tokens")
        chat["max_tokens"] = get_int(body, "max_tokens", lo=1)
        stop = _stop_sequences(body)
        if stop:
            chat["stop"] = stop
        response_format = _response_format(body)
        if response_format is not None:
            chat["response_format"] = response_format
    choice, parallel = _tool_choice(body.get("tool_choice"))
    for key, value in (("tools", _tools(body.get("tools"))), ("tool_choice", choice),
                       ("parallel_tool_calls", parallel)):
        if value is not None:
            chat[key] = value
    if (body.get("thinking") or {}).get("type") == "disabled":  # a thinking model's switch (Qwen3's)
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    return chat, origins


_CHAT_NAMES = ((re.compile(r"\bresponse_format\.json_schema\b"), "output_config.format"),
               (re.compile(r"\btools\[(\d+)\]\.function\.parameters\b"), r"tools[\1].input_schema"),
               (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"))
_MESSAGE = re.compile(r"\bmessages\[(\d+)\]")


def in_messages_terms(err: APIError, origins: list[str]) -> APIError:
    """An error the chat path raised about the translated body, naming the Messages fields instead:
    chat message k as the block or message it was made from."""
    def origin(match: re.Match) -> str:
        k = int(match.group(1))
        return origins[k] if k < len(origins) else match.group(0)

    for pattern, name in _CHAT_NAMES:
        err.message = pattern.sub(name, err.message)
        if err.param is not None:
            err.param = pattern.sub(name, err.param)
    err.message = _MESSAGE.sub(origin, err.message)
    if err.param is not None:
        err.param = _MESSAGE.sub(origin, err.param)
    return err
