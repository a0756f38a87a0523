"""OpenAI's Responses API, stateless as Ollama's (0.13.3+): POST /v1/responses.

A request is translated into a chat completions body (input items -> messages, instructions -> a
system message, text.format -> response_format, flat function tools -> chat tools) and runs through
the chat path (openai.prepare_chat), so templates, tools, structured output and sampling behave as
they do there. Nothing is stored: previous_response_id, conversation and background are refused
with a 400 that says so, and the client sends the whole conversation as input each time. A stream
is the typed events the openai SDK reads (response.created ... response.completed), each with its
sequence_number, as `event:` / `data:` lines and no [DONE] marker, ending in response.completed (its
status `incomplete` when max_output_tokens cut the output)."""
from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tokenmill.engine.output import TextDelta
from tokenmill.server.errors import APIError
from tokenmill.server.generation import Generation, Result, all_deltas
from tokenmill.server.logprobs import chat_entries
from tokenmill.server.openai import ChatJob, chat_message, generations, prepare_chat, respond
from tokenmill.server.openai_responses_input import chat_body, in_responses_terms
from tokenmill.server.streaming import as_api_error, event_stream_response
from tokenmill.server.thinking import ThinkingSplit
from tokenmill.server.validation import read_json


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseView:
    """The response object of one request, filled in as its generation goes (the stream's events
    carry snapshots of it)."""

    def __init__(self, body: dict, job: ChatJob):
        self.body, self.job = body, job
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self.status = "in_progress"
        self.incomplete = False
        self.usage: dict | None = None

    def snapshot(self) -> dict:
        b, params = self.body, self.job.opts.params
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if self.incomplete else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "model": self.job.served.name, "output": [dict(item) for item in self.output],
            "parallel_tool_calls": b.get("parallel_tool_calls", True), "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": params.temperature, "top_p": params.top_p,
            "text": b.get("text") or {"format": {"type": "text"}}, "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [], "truncation": "disabled", "usage": self.usage,
            "metadata": b.get("metadata") or {}, "user": b.get("user"),
        }

    def finish(self, g: Generation, num_output: int, finish_reason: str | None) -> None:
        self.incomplete = finish_reason == "length"
        self.status = "incomplete" if self.incomplete else "completed"
        for item in self.output:
            item["status"] = self.status if item["type"] == "message" else "completed"
        # The reasoning's tokens as its text encodes (a token may straddle the block's end).
        reasoning = "".join(part["text"] for item in self.output if item["type"] == "reasoning"
                            for part in item["content"])
        reasoning_tokens = len(self.job.tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        self.usage = {"input_tokens": g.num_prompt_tokens,
                      "input_tokens_details": {"cached_tokens": g.num_cached_tokens},
                      "output_tokens": num_output,
                      "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, num_output)},
                      "total_tokens": g.num_prompt_tokens + num_output}

    def logprobs(self, ids, lps, top) -> list[dict]:
        return chat_entries(self.job.tok, ids, lps, top) if self.job.opts.params.logprobs and ids else []


def _message_item(text: str, logprobs: list[dict], status: str) -> dict:
    return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _reasoning_item(text: str, status: str) -> dict:
    """A thinking model's reasoning, as open-weight models' reasoning items carry it (gpt-oss in vLLM):
    its text as reasoning_text content, no summary."""
    return {"type": "reasoning", "id": _new_id("rs"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def finished_response(body: dict, job: ChatJob, g: Generation, r: Result) -> dict:
    view = ResponseView(body, job)
    message, reason = chat_message(job.tool_use, r, job.thinking)
    if message.get("reasoning_content"):
        view.output.append(_reasoning_item(message["reasoning_content"], "completed"))
    if message.get("content") or not (message.get("tool_calls") or view.output):  # empty: only an empty answer
        view.output.append(_message_item(message.get("content") or "", view.logprobs(r.token_ids, r.logprobs,
                                                                                      r.top_logprobs), "completed"))
    for call in message.get("tool_calls") or []:
        view.output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"],
                                      "completed"))
    view.finish(g, len(r.token_ids), reason)
    return view.snapshot()


class EventStream:
    """A Responses stream's events for one generation: each text piece as an output_text delta of an
    open message item, each tool call as a function_call item whose arguments arrive as deltas."""

    def __init__(self, view: ResponseView):
        self.view = view
        self.seq = 0
        self.message: dict | None = None  # the open message item
        self.call: dict | None = None     # the open function_call item
        self.reasoning: dict | None = None  # the open reasoning item

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _index(self, item: dict) -> int:
        return self.view.output.index(item)

    def reasoning_text(self, text: str) -> list[dict]:
        out = []
        if self.reasoning is None:
            self.reasoning = _reasoning_item("", "in_progress")
            self.view.output.append(self.reasoning)
            out.append(self.event("response.output_item.added", output_index=self._index(self.reasoning),
                                  item={**self.reasoning, "content": []}))
        self.reasoning["content"][0]["text"] += text
        out.append(self.event("response.reasoning_text.delta", item_id=self.reasoning["id"],
                              output_index=self._index(self.reasoning), content_index=0, delta=text))
        return out

    def close_reasoning(self) -> list[dict]:
        if self.reasoning is None:
            return []
        item, self.reasoning = self.reasoning, None
        i = self._index(item)
        item["status"] = "completed"
        return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                           text=item["content"][0]["text"]),
                self.event("response.output_item.done", output_index=i, item=dict(item))]

    def open_message(self) -> list[dict]:
        if self.message is not None:
            return []
        out = self.close_reasoning() + self.close_call()
        self.message = _message_item("", [], "in_progress")
        self.view.output.append(self.message)
        i = self._index(self.message)
        out.append(self.event("response.output_item.added", output_index=i,
                              item={**self.message, "content": []}))
        out.append(self.event("response.content_part.added", item_id=self.message["id"], output_index=i,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def text(self, text: str, logprobs: list[dict]) -> list[dict]:
        out = self.open_message()
        part = self.message["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        out.append(self.event("response.output_text.delta", item_id=self.message["id"],
                              output_index=self._index(self.message), content_index=0, delta=text,
                              logprobs=logprobs))
        return out

    def close_message(self, status: str = "completed") -> list[dict]:
        if self.message is None:
            return []
        m, self.message = self.message, None
        i, part = self._index(m), m["content"][0]
        m["status"] = status
        return [self.event("response.output_text.done", item_id=m["id"], output_index=i, content_index=0,
                           text=part["text"], logprobs=part["logprobs"]),
                self.event("response.content_part.done", item_id=m["id"], output_index=i, content_index=0,
                           part=dict(part)),
                self.event("response.output_item.done", output_index=i, item=dict(m))]

    def start_call(self, call_id: str, name: str, arguments: str) -> list[dict]:
        out = self.close_reasoning() + self.close_message() + self.close_call()
        self.call = _call_item(call_id, name, "", "in_progress")
        self.view.output.append(self.call)
        out.append(self.event("response.output_item.added", output_index=self._index(self.call), item=dict(self.call)))
        return out + self.arguments(arguments)

    def arguments(self, delta: str) -> list[dict]:
        if not delta or self.call is None:
            return []
        self.call["arguments"] += delta
        return [self.event("response.function_call_arguments.delta", item_id=self.call["id"],
                           output_index=self._index(self.call), delta=delta)]

    def close_call(self) -> list[dict]:
        if self.call is None:
            return []
        c, self.call = self.call, None
        i = self._index(c)
        c["status"] = "completed"
        return [self.event("response.function_call_arguments.done", item_id=c["id"], output_index=i,
                           arguments=c["arguments"]),
                self.event("response.output_item.done", output_index=i, item=dict(c))]


def _delta_events(events: EventStream, parser, split: ThinkingSplit | None, d: TextDelta) -> list[dict]:
    """A delta's events: a thinking model's reasoning (`split`), then its text (with its logprobs), or
    with tools, what the call parser makes of it."""
    text, out = d.text, []
    if split is not None:
        reasoning, text = split.take(d.text, d.finished)
        out = events.reasoning_text(reasoning) if reasoning else []
    if parser is None:
        logprobs = events.view.logprobs(d.token_ids, d.logprobs, d.top_logprobs)
        return out + (events.text(text, logprobs) if text or logprobs else [])
    for p in parser.feed(text) + (parser.finish() if d.finished else []):
        if p.content is not None:
            out += events.text(p.content, [])
        elif p.name is not None:
            out += events.start_call(p.call_id, p.name, p.arguments or "")
        else:
            out += events.arguments(p.arguments or "")
    return out


async def _events(body: dict, job: ChatJob, gens: list[Generation]) -> AsyncIterator[dict]:
    view = ResponseView(body, job)
    events = EventStream(view)
    yield events.event("response.created", response=view.snapshot())
    yield events.event("response.in_progress", response=view.snapshot())
    parser = job.tool_use.stream() if job.tool_use.active else None
    split = job.thinking.split() if job.thinking is not None else None
    count, reason = 0, None
    try:
        # Closed here however the stream ends (a client gone included), which aborts the generation.
        async with contextlib.aclosing(all_deltas(gens)) as deltas:
            async for _, d in deltas:
                count += len(d.token_ids)
                for ev in _delta_events(events, parser, split, d):
                    yield ev
                if d.finished:
                    reason = d.finish_reason
    except Exception as exc:  # noqa: BLE001 - the status is sent: the failure is the stream's last event
        err = as_api_error(exc)
        yield events.event("error", code=err.code, message=err.message, param=err.param)
        return
    ended = "incomplete" if reason == "length" else "completed"  # what max_output_tokens cut is incomplete
    if not view.output:  # nothing written: an empty message, as the non-streaming response has
        for ev in events.open_message():
            yield ev
    for ev in events.close_reasoning() + events.close_message(ended) + events.close_call():
        yield ev
    view.finish(gens[0], count, reason)
    # response.completed however it ended (its status says incomplete when max_output_tokens cut it), as
    # vLLM and SGLang send: the openai SDK's stream helper waits for that event alone.
    yield events.event("response.completed", response=view.snapshot())


async def responses(request: Request) -> Response:
    body = await read_json(request)
    chat = chat_body(body)
    try:
        job = await prepare_chat(request, chat, reasoning=True)
    except APIError as err:
        raise in_responses_terms(err) from None
    job.opts.field_names.update({"max_tokens": "max_output_tokens", "top_logprobs": "top_logprobs"})

    def finish_body(gens: list[Generation], results: list[Result]) -> dict:
        return finished_response(body, job, gens[0], results[0])

    return await respond(request, lambda: generations(job.served, [job.prompt_ids], job.opts, "input"), job.opts, 1,
                         lambda gens: _events(body, job, gens), finish_body, stream_response=event_stream_response)


def routes() -> list[Route]:
    return [Route("/v1/responses", responses, methods=["POST"])]
