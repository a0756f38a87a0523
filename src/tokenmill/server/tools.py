"""Tool calling, shared by the OpenAI and Ollama chat APIs: the request's `tools` and `tool_choice`,
the prompt that shows them to the model, the grammar that forces a call, and the calls parsed
back out of the text.

A template that mentions `tools` renders them itself. For one that does not (SmolLM2's, Gemma's),
the documented default format applies: a system message lists the functions and asks for
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; earlier calls are written back in that
form and tool results go in as user turns wrapped in `<tool_response>`. `tool_choice` "required" or a
named function constrains the output to such a call (as bare JSON) whose arguments match the
function's parameters schema, so it always parses and validates; "required" with
`parallel_tool_calls` (the default) allows a JSON list of one or more calls. With
`parallel_tool_calls: false` at most one call is returned."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenmill.server.errors import bad_request
from tokenmill.server.tool_stream import ToolCallStream, new_call_id
from tokenmill.server.validation import get_bool
from tokenmill.structured import GrammarError, GrammarSpec, check_finite, rebase_refs
from tokenmill.tokenizer import Tokenizer

_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)

DEFAULT_INSTRUCTIONS = (
    "You can call the following functions. To call one, answer with only\n"
    '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
    "Functions:\n"
)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or new_call_id()

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return out if index is None else {"index": index, **out}

    def ollama(self) -> dict:
        return {"function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolUse:
    """What a request asked about tools. `tools` is empty when there are none or choice is "none"."""
    tools: list[Tool]
    choice: str = "auto"  # auto | none | required | function
    function: str | None = None  # the named function when choice == "function"
    parallel: bool = True  # OpenAI's parallel_tool_calls: several calls in one answer

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    @property
    def active(self) -> bool:
        return bool(self.tools)

    def constraint(self) -> tuple[GrammarSpec, str] | None:
        """For required or a named function: one call, as JSON, with validating arguments. Each
        function's parameters go in the schema's `$defs`, their own refs ("#", "#/$defs/node")
        rewritten to point there, so a recursive parameters schema means what it meant alone."""
        if self.choice not in ("required", "function"):
            return None
        defs, calls = {}, []
        for i, t in enumerate(self.tools):
            if self.choice == "function" and t.name != self.function:
                continue
            where = f"tools[{i}].function.parameters"
            try:
                check_finite(t.parameters)
                defs[f"tool_{i}"] = rebase_refs(t.parameters, f"#/$defs/tool_{i}")
            except GrammarError as exc:
                raise bad_request(f"{where}: {exc}", where) from None
            except RecursionError:
                raise bad_request(f"{where} is nested too deeply", where) from None
            calls.append({"type": "object", "properties": {"name": {"const": t.name},
                                                           "arguments": {"$ref": f"#/$defs/tool_{i}"}},
                          "required": ["name", "arguments"], "additionalProperties": False})
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.choice == "required" and self.parallel:
            schema = {"type": "array", "items": schema, "minItems": 1}
        return GrammarSpec("json_schema", {**schema, "$defs": defs}), "tools"

    def stream(self) -> ToolCallStream:
        """A parser that finds this request's calls in text as it is generated."""
        return ToolCallStream({t.name for t in self.tools}, self.max_calls)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text without its calls or None if nothing is left, the calls to known functions)."""
        names = {t.name for t in self.tools}
        calls: list[ToolCall] = []
        blocks = list(_CALL_BLOCK.finditer(text))
        if blocks:
            for m in blocks:
                calls += _calls_in(m.group(1), names)
            rest = _CALL_BLOCK.sub("", text).strip()
        else:
            body = text.strip()
            fenced = _FENCE.match(body)
            calls = _calls_in(fenced.group(1) if fenced else body, names)
            rest = "" if calls else text
        if not calls:
            return text, []
        return rest or None, calls[:self.max_calls]


def parse_tool_use(body: dict, *, allow_choice: bool = True) -> ToolUse:
    tools = _tools(body.get("tools"))
    choice, function = "auto", None
    value = body.get("tool_choice") if allow_choice else None
    if value is not None:
        if value in ("auto", "none", "required"):
            choice = value
        elif isinstance(value, dict) and isinstance(value.get("function"), dict) \
                and isinstance(value["function"].get("name"), str):
            choice, function = "function", value["function"]["name"]
        else:
            raise bad_request('tool_choice must be "auto", "none", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if choice in ("required", "function") and not tools:
        raise bad_request(f"tool_choice {choice if choice != 'function' else function!r} needs tools", "tool_choice")
    if choice == "function" and function not in {t.name for t in tools}:
        raise bad_request(f"tool_choice names {function!r}, which is not among the tools", "tool_choice")
    parallel = get_bool(body, "parallel_tool_calls", True) if allow_choice else True
    return ToolUse([] if choice == "none" else tools, choice, function, parallel)


def template_renders_tools(tokenizer: Tokenizer) -> bool:
    template = tokenizer.chat_template
    return template is not None and "tools" in template.source


def prepare_messages(tokenizer: Tokenizer, messages: list[dict], use: ToolUse) -> tuple[list[dict], list | None]:
    """(messages, tools) for the chat template: its own tool format if it has one, else the default."""
    if template_renders_tools(tokenizer):  # normalized calls already hold their arguments as objects
        return messages, ([_openai_tool(t) for t in use.tools] or None)
    out = _merge_tool_results([_default_message(m) for m in messages], messages)
    if use.tools:
        listing = "\n".join(json.dumps(_openai_tool(t)["function"], ensure_ascii=False) for t in use.tools)
        prompt = DEFAULT_INSTRUCTIONS + listing
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("tools must be a list of function tools", "tools")
    tools = []
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}',
                              f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              f"tools[{i}].function.parameters")
        tools.append(Tool(name, str(fn.get("description") or ""), params))
    return tools


def _calls_in(text: str, names: set[str]) -> list[ToolCall]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or a number or nesting Python will not hold
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return []
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI sends them
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return []
        if item.get("name") not in names or not isinstance(args, dict):
            return []
        calls.append(ToolCall(item["name"], args))
    return calls


def _openai_tool(t: Tool) -> dict:
    fn = {"name": t.name, **({"description": t.description} if t.description else {}), "parameters": t.parameters}
    return {"type": "function", "function": fn}


def _merge_tool_results(out: list[dict], messages: list[dict]) -> list[dict]:
    """One user turn for each run of tool results (a parallel call's answers, as Qwen's template writes
    them): templates that make turns alternate (Gemma's) reject two user turns in a row."""
    merged: list[dict] = []
    for i, m in enumerate(out):
        if i and messages[i]["role"] == "tool" and messages[i - 1]["role"] == "tool":
            merged[-1] = {**merged[-1], "content": f"{merged[-1]['content']}\n{m['content']}"}
        else:
            merged.append(m)
    return merged


def _default_message(m: dict) -> dict:
    """Messages come normalized (chat.normalize_messages): each call is {"function": {"name": str,
    "arguments": dict}}, whatever shape the client sent it in."""
    if m.get("role") == "tool":
        name = m.get("name") or m.get("tool_name")
        head = f"<tool_response name={json.dumps(name)}>" if name else "<tool_response>"
        return {"role": "user", "content": f"{head}\n{m.get('content') or ''}\n</tool_response>"}
    if m.get("role") == "assistant" and m.get("tool_calls"):
        blocks = ["<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) + "</tool_call>" for c in m["tool_calls"]]
        text = "\n".join(filter(None, [m.get("content") or "", *blocks]))
        return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
    return m
