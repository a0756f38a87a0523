"""Anthropic's Messages API, as Ollama (0.14+) and llama-server serve it: POST /v1/messages and
POST /v1/messages/count_tokens, for the `anthropic` SDK and for tools that speak it (Claude Code
with ANTHROPIC_BASE_URL pointed here).

A request is translated into a chat completions body (anthropic_input.py) and runs through the chat
path (openai.prepare_chat), so the template, tools, structured tool calls and sampling behave as
there. The answer is a message of content blocks (a thinking model's thinking, then text, tool_use),
its stop_reason end_turn, max_tokens, stop_sequence or tool_use, and usage with the prefix cache's
share as cache_read_input_tokens. A stream is Anthropic's typed events (message_start,
content_block_start, content_block_delta with thinking_delta / text_delta / input_json_delta,
content_block_stop, message_delta, message_stop), an `error` event when it breaks after it began. Errors are Anthropic's
`{"type": "error", "error": {...}}` (server/errors.py)."""
from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenmill.server.anthropic_input import chat_body, in_messages_terms
from tokenmill.server.errors import APIError
from tokenmill.server.generation import Generation, Result, all_deltas
from tokenmill.server.openai import ChatJob, chat_message, generations, prepare_chat, respond
from tokenmill.server.streaming import as_api_error, event_stream_response
from tokenmill.server.validation import read_json


def stop_reason(finish_reason: str | None, stop_string: str | None, called: bool) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_string is not None else "end_turn"


def usage(g: Generation, num_output: int) -> dict:
    """Anthropic's usage: input_tokens is what was computed, the prefix cache's share is read apart."""
    cached = g.num_cached_tokens
    return {"input_tokens": g.num_prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": num_output}


def thinking_block(text: str) -> dict:
    # No signature: it is Anthropic's proof that the thinking is its model's; clients pass it back as
    # they got it, and past thinking blocks are not rendered here.
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use_block(call_id: str, name: str, arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:  # a call max_tokens cut: its arguments as far as they got are no object yet
        value = None
    return {"type": "tool_use", "id": call_id, "name": name, "input": value if isinstance(value, dict) else {}}


def _message(job: ChatJob, message_id: str, content: list[dict], reason: str | None, stop: str | None,
             used: dict) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": job.served.name,
            "content": content, "stop_reason": reason, "stop_sequence": stop, "usage": used}


def finished_message(job: ChatJob, g: Generation, r: Result) -> dict:
    message, _ = chat_message(job.tool_use, r, job.thinking)
    calls = message.get("tool_calls") or []
    content = [thinking_block(message["reasoning_content"])] if message.get("reasoning_content") else []
    if message.get("content") or not (calls or content):  # an empty text block only for an empty answer
        content.append({"type": "text", "text": message.get("content") or ""})
    content += [tool_use_block(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    reason = stop_reason(r.finish_reason, r.stop_string, bool(calls))
    return _message(job, f"msg_{uuid.uuid4().hex}", content, reason,
                    r.stop_string if reason == "stop_sequence" else None, usage(g, len(r.token_ids)))


class BlockStream:
    """The content-block events of one message: text goes into an open text block, each tool call
    opens a tool_use block whose input arrives as JSON pieces; opening a block closes the one before."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # the open block's type

    def _start(self, block: dict) -> list[dict]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def thinking(self, text: str) -> list[dict]:
        out = [] if self.open == "thinking" else self._start(thinking_block(""))
        return out + [{"type": "content_block_delta", "index": self.index,
                       "delta": {"type": "thinking_delta", "thinking": text}}]

    def text(self, text: str) -> list[dict]:
        out = [] if self.open == "text" else self._start({"type": "text", "text": ""})
        if text:
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "text_delta", "text": text}})
        return out

    def start_call(self, call_id: str, name: str, arguments: str) -> list[dict]:
        return self._start({"type": "tool_use", "id": call_id, "name": name, "input": {}}) + self.arguments(arguments)

    def arguments(self, piece: str) -> list[dict]:
        if not piece or self.open != "tool_use":
            return []
        return [{"type": "content_block_delta", "index": self.index,
                 "delta": {"type": "input_json_delta", "partial_json": piece}}]

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]


async def _events(job: ChatJob, gens: list[Generation]) -> AsyncIterator[dict]:
    g, message_id = gens[0], f"msg_{uuid.uuid4().hex}"
    yield {"type": "message_start", "message": _message(job, message_id, [], None, None, usage(g, 0))}
    yield {"type": "ping"}
    blocks = BlockStream()
    parser = job.tool_use.stream() if job.tool_use.active else None
    split = job.thinking.split() if job.thinking is not None else None
    count, finish, stop = 0, None, None
    try:
        # Closed here however the stream ends (a client gone included), which aborts the generation.
        async with contextlib.aclosing(all_deltas(gens)) as deltas:
            async for _, d in deltas:
                count += len(d.token_ids)
                text, events = d.text, []
                if split is not None:  # a thinking model's reasoning: a thinking block before the answer's
                    reasoning, text = split.take(d.text, d.finished)
                    events = blocks.thinking(reasoning) if reasoning else []
                if parser is None:
                    events += blocks.text(text) if text else []
                else:
                    for p in parser.feed(text) + (parser.finish() if d.finished else []):
                        if p.content is not None:
                            events += blocks.text(p.content)
                        elif p.name is not None:
                            events += blocks.start_call(p.call_id, p.name, p.arguments or "")
                        else:
                            events += blocks.arguments(p.arguments or "")
                for ev in events:
                    yield ev
                if d.finished:
                    finish, stop = d.finish_reason, d.stop_string
    except Exception as exc:  # noqa: BLE001 - the status is sent: the failure is the stream's last event
        yield as_api_error(exc).anthropic_body()
        return
    if blocks.index < 0:  # nothing written: an empty text block, as the non-streaming message has
        for ev in blocks.text(""):
            yield ev
    for ev in blocks.close():
        yield ev
    reason = stop_reason(finish, stop, parser is not None and parser.num_calls > 0)
    yield {"type": "message_delta", "delta": {"stop_reason": reason,
                                              "stop_sequence": stop if reason == "stop_sequence" else None},
           "usage": usage(g, count)}  # cumulative: input_tokens now with the prefix cache's share known
    yield {"type": "message_stop"}


async def _prepared(request: Request, *, count_only: bool = False) -> ChatJob:
    chat, origins = chat_body(await read_json(request), count_only=count_only)
    try:
        job = await prepare_chat(request, chat, reasoning=True)
    except APIError as err:
        raise in_messages_terms(err, origins) from None
    job.opts.field_names.update({"stop": "stop_sequences"})
    return job


async def messages(request: Request) -> Response:
    job = await _prepared(request)

    def finish_body(gens: list[Generation], results: list[Result]) -> dict:
        return finished_message(job, gens[0], results[0])

    return await respond(request, lambda: generations(job.served, [job.prompt_ids], job.opts, "messages"), job.opts,
                         1, lambda gens: _events(job, gens), finish_body, stream_response=event_stream_response)


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as the model's template renders the conversation and its tools."""
    job = await _prepared(request, count_only=True)
    return JSONResponse({"input_tokens": len(job.prompt_ids)})


def routes() -> list[Route]:
    return [Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
