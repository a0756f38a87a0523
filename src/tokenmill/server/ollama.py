"""Ollama's generation API: /api/generate, /api/chat, /api/embed and the legacy /api/embeddings.
Streams NDJSON by default, as Ollama does; the last object carries done_reason, the token counts
and the durations in nanoseconds.

Context as Ollama manages it: options.num_ctx sets the request's context, a prompt that does not fit
is cut to its first options.num_keep tokens plus the newest tail, and a generation that fills the
context drops the older half after num_keep and goes on. `"truncate": false` turns the first into a
400, `"shift": false` the second into a `length` finish."""
from __future__ import annotations

import datetime as dt
import math
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenmill.keep_alive import KeepAliveError, parse_keep_alive
from tokenmill.server import profiles
from tokenmill.server.chat import (
    chars_in,
    check_token_ids,
    encode_prompt,
    normalize_messages,
    off_loop,
    render_chat,
    render_prompt,
)
from tokenmill.server.embedding import embed, embedding_limit, fit_to_context, requested_dimensions
from tokenmill.server.errors import APIError, bad_request, shown_value
from tokenmill.server.generation import Generation, Timings
from tokenmill.server.logprobs import chat_entries
from tokenmill.server.model_host import KEEP_DEFAULT, ModelHost, ServedModel, model_for
from tokenmill.server.ollama_params import FIELD_NAMES, OllamaOptions, parse_options
from tokenmill.server.streaming import ndjson_response, unless_disconnected
from tokenmill.server.structured_params import add_constraint, ollama_spec
from tokenmill.server.ollama_tool_stream import OllamaCallStream
from tokenmill.server.thinking import Thinking, grammar_can_wait, model_thinks, reading_and_grammar
from tokenmill.server.tools import ToolUse, parse_tool_use, prepare_messages
from tokenmill.server.validation import (
    get_bool,
    get_dict,
    get_int,
    get_priority,
    get_str,
    model_field,
    read_json,
    warn_once,
    warn_unknown,
)

COMMON_FIELDS = {"model", "options", "stream", "keep_alive", "format", "think", "logprobs", "top_logprobs",
                 "priority", "truncate", "shift"}
GENERATE_FIELDS = COMMON_FIELDS | {"prompt", "suffix", "images", "system", "template", "context", "raw"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "tools"}
EMBED_FIELDS = {"model", "input", "truncate", "options", "keep_alive", "dimensions"}
EMBEDDINGS_FIELDS = {"model", "prompt", "options", "keep_alive"}


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _host(request: Request) -> ModelHost:
    return request.app.state.host


def _model_field(body: dict) -> str:
    return model_field(body)  # `model`, or `name` as pre-0.2 clients sent it


class Shape:
    """Where the text goes in a response object: `response` for generate, `message` for chat."""

    def __init__(self, chat: bool, model: str, tool_use: ToolUse | None = None):
        self.chat = chat
        self.model = model
        self.tool_use = tool_use
        self.thinking: Thinking | None = None  # a thinking model's answer: its reasoning goes in `thinking`

    @property
    def finds_calls(self) -> bool:
        """With tools, the text is read for calls: a stream's as it comes (ollama_tool_stream.py), a
        whole answer's at its end."""
        return self.tool_use is not None and self.tool_use.active

    def chunk(self, text: str, logprobs: list | None = None, tool_calls: list | None = None,
              thinking: str = "") -> dict:
        obj = {"model": self.model, "created_at": now_iso()}
        if self.chat:
            obj["message"] = {"role": "assistant", "content": text}
            if thinking:
                obj["message"]["thinking"] = thinking
            if tool_calls:
                obj["message"]["tool_calls"] = tool_calls
        else:
            obj["response"] = text
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = False
        if logprobs is not None:
            obj["logprobs"] = logprobs
        return obj

    def final(self, gen: Generation, text: str, done_reason: str, output_ids: list[int],
              logprobs: list | None, thinking: str = "") -> dict:
        """The last object; `text` is the answer (a stream's last piece of it), its reasoning apart."""
        obj = self.chunk(text, logprobs, thinking=thinking)
        if self.finds_calls and text:
            content, calls = self.tool_use.extract(text)
            if calls:
                obj["message"].update(content=content or "", tool_calls=[c.ollama() for c in calls])
        obj.update(done=True, done_reason=done_reason)
        if not self.chat:
            obj["context"] = gen.prompt_ids + output_ids  # lets a client continue from here
        obj.update(gen.timings.ollama(), prompt_eval_count=gen.num_prompt_tokens, eval_count=len(output_ids))
        return obj

    def loaded(self) -> dict:
        """Ollama's answer to an empty prompt: the model is (already) loaded, nothing generated."""
        obj = self.chunk("")
        obj.update(done=True, done_reason="load")
        return obj


def _logprobs(gen: Generation, ids: list[int], lps, top) -> list | None:
    if not gen.params.logprobs:
        return None
    return chat_entries(gen.served.engine.tokenizer, ids, lps, top)


async def _stream(gen: Generation, shape: Shape):
    output: list[int] = []
    calls = OllamaCallStream(shape.tool_use) if shape.finds_calls else None
    split = shape.thinking.split() if shape.thinking is not None else None
    async for _, d in gen.deltas():
        output += d.token_ids
        lp = _logprobs(gen, d.token_ids, d.logprobs, d.top_logprobs)
        text = d.text
        if split is not None:  # the reasoning in chunks of its own, before the answer's (Ollama's order)
            thought, text = split.take(d.text, d.finished)
            if thought:
                yield shape.chunk("", lp, thinking=thought)
                lp = None
        if calls is not None:
            # Content as it comes, each call once complete; a delta's logprobs ride on its first message.
            messages = calls.feed(text, d.finished)
            for i, m in enumerate(messages):
                yield shape.chunk(m["content"], lp if i == 0 else None, m.get("tool_calls"))
            if d.finished:
                yield shape.final(gen, "", d.finish_reason, output, None if messages else lp)
            elif lp and not messages:
                yield shape.chunk("", lp)
            continue
        if d.finished:
            yield shape.final(gen, text, d.finish_reason, output, lp)
        elif text or lp:
            yield shape.chunk(text, lp)


async def _respond(request: Request, served: ServedModel, ids: list[int], opts: OllamaOptions, body: dict,
                   shape: Shape, timings: Timings, prompt_field: str) -> Response:
    stream = get_bool(body, "stream", True)
    priority = get_priority(body)
    truncate, shift = get_bool(body, "truncate", True), get_bool(body, "shift", True) and not opts.fill_context
    # num_keep -1: keep the whole prompt (as much of it as fits), as llama.cpp's n_keep -1.
    num_keep = len(ids) if opts.num_keep == -1 else opts.num_keep
    slot = _host(request).admission.enter()
    try:
        gen = Generation(served, ids, opts.params, priority=priority, num_ctx=opts.num_ctx, num_keep=num_keep,
                         truncate=truncate, shift=shift, field_names=FIELD_NAMES, prompt_field=prompt_field,
                         timings=timings)
        if stream:
            # The response owns the slot from here: it is released when the stream ends, however it ends.
            response, slot = ndjson_response(_stream(gen, shape), on_close=slot.release), None
            return response
        [result] = await unless_disconnected(request, gen.collect())
    finally:
        if slot is not None:
            slot.release()
    lp = _logprobs(gen, result.token_ids, result.logprobs, result.top_logprobs)
    thinking, text = shape.thinking.split_text(result.text) if shape.thinking is not None else ("", result.text)
    return JSONResponse(shape.final(gen, text, result.finish_reason or "stop", result.token_ids, lp, thinking))


def _think(body: dict, name: str, tok, *, constrained: bool) -> tuple[bool, dict]:
    """Ollama's `think`: (whether to read the answer's reasoning apart, the template variables that
    say so). A thinking model (its template writes think tags) thinks unless `think` is false, which
    renders its template with `enable_thinking` false (Qwen3's switch), as does a grammar that holds from
    the first token (`constrained`: a regex or grammar of the client's, which leaves no room to think; a
    JSON format waits for the reasoning instead, grammar_can_wait); a model without the capability gets
    Ollama's 400 for `think: true` rather than an answer that silently has no thinking. The levels
    ("high", ...) are gpt-oss's; a model here that thinks takes them as true."""
    think = body.get("think")
    if think is not None and not isinstance(think, bool) and think not in ("high", "medium", "low"):
        raise bad_request(f'think must be true, false, "high", "medium" or "low", got {shown_value(think)}', "think")
    if not model_thinks(tok):
        if think is None or think is False:
            return False, {}
        raise bad_request(f'"{name}" does not support thinking', "think")
    if think is False:
        return False, {"enable_thinking": False}
    return True, {"enable_thinking": False} if constrained else {}


def _ignore_unsupported(body: dict, where: str) -> None:
    if body.get("template"):  # /api/generate's field; Ollama's /api/chat has none
        warn_once(where, "template", "custom templates are not supported; the model's own is used")


async def generate(request: Request) -> Response:
    timings = Timings()
    body = await read_json(request)
    warn_unknown(body, GENERATE_FIELDS, "/api/generate")
    keep_alive = keep_alive_field(body)
    prompt = get_str(body, "prompt", "")
    if body.get("images"):
        raise bad_request("images: this model accepts text only", "images")
    if get_str(body, "suffix"):
        raise bad_request("suffix: this model does not support fill-in-the-middle", "suffix")
    template = get_str(body, "template")
    if not prompt and not body.get("context"):
        return await _load_or_unload(request, body, keep_alive, chat=False)
    served = await model_for(request, _model_field(body), keep_alive)
    body = profiles.ollama_body(body, served.profile)
    shape = Shape(False, served.name)
    tok = profiles.tokenizer_for(served.engine.tokenizer, served.profile)
    context = check_token_ids(body["context"], tok.vocab_size, "context") if body.get("context") else []
    opts = parse_options(body, "/api/generate")
    constraint = ollama_spec(body)
    system, raw = profiles.system_prompt(get_str(body, "system"), served.profile), bool(get_bool(body, "raw"))
    if template and not raw:  # Ollama's per-request template, in place of the model's
        tok = await off_loop(lambda: profiles.with_request_template(tok, template), len(template))
    waits = constraint is not None and grammar_can_wait(tok, constraint[0])
    think, variables = _think(body, served.name, tok, constrained=constraint is not None and not waits)
    ids = context + await off_loop(lambda: render_prompt(tok, prompt, system=system, raw=raw, **variables),
                                   len(prompt))
    if not raw:  # a raw prompt is the client's own: its answer comes back as written
        shape.thinking, constraint = reading_and_grammar(tok, ids, constraint, wanted=think, can_wait=waits)
    await add_constraint(opts.params, tok, constraint)
    return await _respond(request, served, ids, opts, body, shape, timings, "prompt")


async def chat(request: Request) -> Response:
    timings = Timings()
    body = await read_json(request)
    warn_unknown(body, CHAT_FIELDS, "/api/chat")
    keep_alive = keep_alive_field(body)
    tool_use = parse_tool_use(body, allow_choice=False)  # Ollama has no tool_choice: the model decides
    messages = normalize_messages(body.get("messages") or [], text_arguments=False)
    _ignore_unsupported(body, "/api/chat")
    if not messages:
        return await _load_or_unload(request, body, keep_alive, chat=True)
    served = await model_for(request, _model_field(body), keep_alive)
    body = profiles.ollama_body(body, served.profile)
    shape = Shape(True, served.name, tool_use)
    opts = parse_options(body, "/api/chat")
    constraint = ollama_spec(body)
    tok = profiles.tokenizer_for(served.engine.tokenizer, served.profile)
    waits = constraint is not None and grammar_can_wait(tok, constraint[0])
    think, variables = _think(body, served.name, tok, constrained=constraint is not None and not waits)
    messages, tools = prepare_messages(tok, profiles.chat_messages(messages, served.profile), tool_use)
    prefill = ends_in_prefill(messages)
    ids = await off_loop(lambda: render_chat(tok, messages, tools=tools, continue_final_message=prefill,
                                             **variables), chars_in(messages))
    if not prefill:  # a continued answer is the client's own text going on: as written
        shape.thinking, constraint = reading_and_grammar(tok, ids, constraint, wanted=think, can_wait=waits)
    await add_constraint(opts.params, tok, constraint)
    return await _respond(request, served, ids, opts, body, shape, timings, "messages")


def ends_in_prefill(messages: list[dict]) -> bool:
    """Whether the conversation ends with the assistant's own text, which Ollama's /api/chat continues
    (the answer is what the model writes after it) rather than answering with a new turn."""
    final = messages[-1]
    return final["role"] == "assistant" and bool((final.get("content") or "").strip()) and not final.get("tool_calls")


def keep_alive_field(body: dict) -> object:
    if body.get("keep_alive") is None:
        return KEEP_DEFAULT
    try:
        return parse_keep_alive(body["keep_alive"])
    except KeepAliveError as exc:
        raise bad_request(str(exc), "keep_alive") from None


async def _load_or_unload(request: Request, body: dict, keep_alive: object, *, chat: bool) -> Response:
    """An empty prompt (or no messages) loads the model, or with keep_alive 0 unloads it (Ollama)."""
    name = _model_field(body)
    if keep_alive == 0:
        host = _host(request)
        if not host.unload(name):
            await run_in_threadpool(_check_installed, name, host.served_files())
        obj = Shape(chat, name).chunk("")
        obj.update(done=True, done_reason="unload")
        return JSONResponse(obj)
    served = await model_for(request, name, keep_alive)
    return JSONResponse(Shape(chat, served.name).loaded())


def _check_installed(name: str, served_files: list[str]) -> None:
    from tokenmill.store import StoreError
    from tokenmill.store.names import resolve_requested

    try:
        resolve_requested(name, served_files)
    except StoreError:
        raise APIError(404, f"model \"{name}\" not found, try pulling it first", param="model") from None


def _inputs(value, field: str) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        if any(not s for s in value):
            raise bad_request(f"{field}: inputs must not be empty strings", field)
        return value
    raise bad_request(f"{field} must be a string or a list of strings", field)


def _shorten(vec: list[float], dims: int | None) -> list[float]:
    if dims is None or dims >= len(vec):
        return vec
    head = vec[:dims]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


async def _embed_all(request: Request, served: ServedModel, texts: list[str], truncate: bool, num_ctx: int | None,
                     field: str) -> tuple[list[list[float]], int]:
    tok = served.engine.tokenizer
    limit = embedding_limit(served) if num_ctx is None else min(num_ctx, embedding_limit(served))
    encoded = await off_loop(lambda: [encode_prompt(tok, t) for t in texts], chars_in(texts))
    id_lists = [fit_to_context(ids, limit, truncate, field) for ids in encoded]
    slot = _host(request).admission.enter()
    try:
        vectors = [await embed(served, ids) for ids in id_lists]
    finally:
        slot.release()
    return vectors, sum(len(ids) for ids in id_lists)


async def embed_endpoint(request: Request) -> Response:
    start = time.perf_counter()
    body = await read_json(request)
    warn_unknown(body, EMBED_FIELDS, "/api/embed")
    served = await model_for(request, _model_field(body), keep_alive_field(body))
    texts = _inputs(body.get("input"), "input")
    dims = requested_dimensions(body, served)
    num_ctx = get_int(get_dict(body, "options"), "num_ctx", lo=2, label="options.num_ctx")
    # Ollama truncates over-long inputs unless told not to.
    vectors, count = await _embed_all(request, served, texts, get_bool(body, "truncate", True), num_ctx, "input")
    total = int((time.perf_counter() - start) * 1e9)
    return JSONResponse({"model": served.name, "embeddings": [_shorten(v, dims) for v in vectors],
                         "total_duration": total, "load_duration": 0, "prompt_eval_count": count})


async def embeddings_legacy(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, EMBEDDINGS_FIELDS, "/api/embeddings")
    served = await model_for(request, _model_field(body), keep_alive_field(body))
    prompt = get_str(body, "prompt", "")
    if not prompt:
        return JSONResponse({"embedding": []})
    num_ctx = get_int(get_dict(body, "options"), "num_ctx", lo=2, label="options.num_ctx")
    vectors, _ = await _embed_all(request, served, [prompt], True, num_ctx, "prompt")
    return JSONResponse({"embedding": vectors[0]})


def routes() -> list[Route]:
    return [
        Route("/api/generate", generate, methods=["POST"]),
        Route("/api/chat", chat, methods=["POST"]),
        Route("/api/embed", embed_endpoint, methods=["POST"]),
        Route("/api/embeddings", embeddings_legacy, methods=["POST"]),
    ]
