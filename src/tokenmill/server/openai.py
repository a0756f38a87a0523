"""OpenAI's API: /v1/chat/completions and /v1/completions (SSE streaming ending in `data: [DONE]`),
/v1/models. n > 1 is one engine request per prompt with n samples: the prompt is computed once and
its KV blocks are shared (sample i draws from seed + i when a seed is given)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenmill.server import anthropic_models, model_info, profiles
from tokenmill.server.chat import chars_in, check_token_ids, encode_prompt, normalize_messages, off_loop, render_chat
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.generation import Generation, Result, all_deltas, collect_all
from tokenmill.server.logprobs import chat_entries, completion_logprobs, echo_logprobs, joined_logprobs
from tokenmill.server.model_host import ModelHost, ServedModel, model_for
from tokenmill.server.openai_embeddings import embeddings
from tokenmill.server.openai_params import (
    OpenAIOptions,
    parse_options,
    refuse_unsupported,
    template_options,
    truncate_prompt,
)
from tokenmill.server.predicted_outputs import prediction_ids, prediction_text, prediction_usage
from tokenmill.server.streaming import sse_response, unless_disconnected
from tokenmill.server.structured_params import add_constraint, openai_spec
from tokenmill.server.thinking import Thinking, grammar_can_wait, reading_and_grammar
from tokenmill.server.tool_stream import Piece
from tokenmill.server.tools import ToolUse, parse_tool_use, prepare_messages
from tokenmill.server.validation import check_name_field, get_bool, get_int, get_model_name, get_str, read_json
from tokenmill.tokenizer import Tokenizer

SYSTEM_FINGERPRINT = "tokenmill"


def _host(request: Request) -> ModelHost:
    return request.app.state.host


class Envelope:
    """The fields every response object of one request shares."""

    def __init__(self, kind: str, model: str, include_usage: bool = False):
        self.id = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = kind
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def wrap(self, choices: list[dict], obj: str | None = None, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": obj or self.object, "created": self.created, "model": self.model,
               "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}
        if usage is not None or self.include_usage:
            out["usage"] = usage
        return out


def usage(num_prompt: int, num_completion: int, num_cached: int = 0) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion, "prompt_tokens_details": {"cached_tokens": num_cached}}


def generations(served: ServedModel, prompts: list[list[int]], opts: OpenAIOptions, prompt_field: str
                ) -> list[Generation]:
    """One generation of n samples per prompt; choice index = prompt index * n + sample index."""
    limit = served.engine.max_model_len
    return [Generation(served, truncate_prompt(ids, opts.truncate_prompt_tokens, limit), opts.params, n=opts.n,
                       priority=opts.priority, field_names=opts.field_names, prompt_field=prompt_field)
            for ids in prompts]


async def respond(request: Request, gens_factory, opts: OpenAIOptions, num_requests: int, stream_body, finish_body,
                  stream_response=sse_response):
    """Admission, then either a stream (stream_response of stream_body's objects: OpenAI's SSE) or
    the collected results."""
    slot = _host(request).admission.enter(num_requests)
    try:
        gens = gens_factory()
        if opts.stream:
            # The response owns the slot from here: it is released when the stream ends, however it ends.
            response, slot = stream_response(stream_body(gens), on_close=slot.release), None
            return response
        results = await unless_disconnected(request, collect_all(gens))
    finally:
        if slot is not None:
            slot.release()
    return JSONResponse(finish_body(gens, results))


def _total_usage(gens: list[Generation], counts: list[int], outputs: list[list[int]] | None = None) -> dict:
    """The request's usage; with the choices' output ids (`outputs`) and a predicted output, how much of
    the prediction they used (completion_tokens_details, as OpenAI reports it)."""
    # The prompt is counted once per prompt, as OpenAI bills n choices of one prompt.
    out = usage(sum(g.num_prompt_tokens for g in gens), sum(counts), sum(g.num_cached_tokens for g in gens))
    prediction = gens[0].params.prediction_ids if gens else ()
    if prediction and outputs is not None:
        out["completion_tokens_details"] = prediction_usage(prediction, outputs)
    return out


def _by_choice(gens: list[Generation]) -> list[Generation]:
    """The generation behind each choice index."""
    return [g for g in gens for _ in range(g.n)]


def _running_usage(opts: OpenAIOptions, g: Generation, count: int) -> dict | None:
    """vLLM's continuous_usage_stats: each chunk of a choice carries its usage so far (its prompt and
    the tokens it has generated); None (the chunk's usage: null) without it."""
    return usage(g.num_prompt_tokens, count, g.num_cached_tokens) if opts.continuous_usage else None


# --- /v1/chat/completions -------------------------------------------------------------------------
@dataclass
class ChatJob:
    """A chat request made ready to generate: its model, options, tokenizer, tools and prompt."""
    served: ServedModel
    opts: OpenAIOptions
    tok: Tokenizer
    tool_use: ToolUse
    prompt_ids: list[int]
    thinking: Thinking | None = None  # a thinking model's answer: its reasoning is read apart


async def prepare_chat(request: Request, body: dict, *, reasoning: bool = False) -> ChatJob:
    """A chat completions body checked, its messages rendered by the model's template and its
    constraint compiled (shared with /v1/responses and Anthropic's /v1/messages, which are translated
    into such a body). `reasoning`: a thinking model's reasoning is read apart from its answer (unless
    chat_template_kwargs.enable_thinking is false)."""
    served = await model_for(request, get_model_name(body))
    body = profiles.openai_body(body, served.profile)
    opts = parse_options(body, chat=True)
    refuse_unsupported(body)
    template = template_options(body)
    tok = profiles.tokenizer_for(served.engine.tokenizer, served.profile)
    tool_use = parse_tool_use(body)
    constraint = _one_constraint(openai_spec(body), tool_use)
    messages = normalize_messages(body.get("messages"))
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    messages, tools = prepare_messages(tok, profiles.chat_messages(messages, served.profile), tool_use)
    ids = await off_loop(lambda: render_chat(tok, messages, tools=tools, **template),
                         chars_in(messages) + chars_in(template))
    thinking = None
    if reasoning and not template["continue_final_message"]:  # a continued message is the client's own text
        # A JSON format or forced tool call waits for the reasoning (vLLM with a reasoning parser).
        thinking, constraint = reading_and_grammar(
            tok, ids, constraint, wanted=template.get("enable_thinking") is not False,
            can_wait=constraint is not None and grammar_can_wait(tok, constraint[0]))
    await add_constraint(opts.params, tok, constraint)
    predicted = prediction_text(body)
    if predicted:
        limit = served.engine.max_model_len
        opts.params.prediction_ids = await off_loop(lambda: prediction_ids(tok, predicted, limit), len(predicted))
    return ChatJob(served, opts, tok, tool_use, ids, thinking)


async def chat_completions(request: Request) -> Response:
    job = await prepare_chat(request, await read_json(request), reasoning=True)
    served, opts, tok, tool_use, ids = job.served, job.opts, job.tok, job.tool_use, job.prompt_ids
    env = Envelope("chat.completion", served.name, opts.include_usage)

    def logprobs_of(ids_, lps, top):
        return {"content": chat_entries(tok, ids_, lps, top)} if opts.params.logprobs and ids_ else None

    async def stream_body(gens: list[Generation]):
        by_choice = _by_choice(gens)
        num_choices = len(by_choice)
        counts = [0] * num_choices

        def chunk(i: int, delta: dict, lp=None, reason=None) -> dict:
            return env.wrap([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}],
                            "chat.completion.chunk", _running_usage(opts, by_choice[i], counts[i]))

        for i in range(num_choices):
            yield chunk(i, {"role": "assistant", "content": ""})
        # With tools, each choice's text goes through a parser that sends calls as they are written;
        # a thinking model's, first through a split that sends its reasoning as reasoning_content.
        parsers = [tool_use.stream() for _ in range(num_choices)] if tool_use.active else None
        splits = [job.thinking.split() for _ in range(num_choices)] if job.thinking is not None else None
        outputs: list[list[int]] = [[] for _ in range(num_choices)]  # for a prediction's usage
        async for i, d in all_deltas(gens):
            counts[i] += len(d.token_ids)
            outputs[i] += d.token_ids
            lp = logprobs_of(d.token_ids, d.logprobs, d.top_logprobs)
            text, deltas = d.text, []
            if splits is not None:
                reasoning, text = splits[i].take(d.text, d.finished)
                deltas = [{"reasoning_content": reasoning}] if reasoning else []
            if parsers is None:
                deltas += [{"content": text}] if text else []
            else:
                pieces = parsers[i].feed(text) + (parsers[i].finish() if d.finished else [])
                deltas += [_tool_delta(p) for p in pieces]
            if lp and not deltas:
                deltas = [{}]
            for j, delta in enumerate(deltas):
                yield chunk(i, delta, lp if j == 0 else None)
            if d.finished:
                called = parsers is not None and parsers[i].num_calls > 0
                reason = "tool_calls" if called and d.finish_reason == "stop" else d.finish_reason
                yield chunk(i, {}, reason=reason)
        if opts.include_usage:
            yield env.wrap([], "chat.completion.chunk", _total_usage(gens, counts, outputs))

    def finish_body(gens: list[Generation], results: list[Result]) -> dict:
        choices = []
        for i, r in enumerate(results):
            message, reason = chat_message(tool_use, r, job.thinking)
            choices.append({"index": i, "message": message,
                            "logprobs": logprobs_of(r.token_ids, r.logprobs, r.top_logprobs), "finish_reason": reason})
        return env.wrap(choices, usage=_total_usage(gens, [len(r.token_ids) for r in results],
                                                    [r.token_ids for r in results]))

    return await respond(request, lambda: generations(served, [ids], opts, "messages"), opts, opts.n,
                         stream_body, finish_body)


def _one_constraint(found, tool_use: ToolUse):
    forced = tool_use.constraint()
    if forced is not None and found is not None:
        raise bad_request(f"tool_choice {tool_use.choice!r} cannot be combined with {found[1]}", "tool_choice")
    return forced or found


def chat_message(tool_use: ToolUse, r: Result, thinking: Thinking | None = None) -> tuple[dict, str | None]:
    """The assistant message of a finished choice, with its reasoning (`thinking`: a thinking model's,
    as `reasoning_content`) and its tool calls parsed out, and the finish reason."""
    reasoning, text = thinking.split_text(r.text) if thinking is not None else ("", r.text)
    message: dict = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    content, calls = tool_use.extract(text) if tool_use.active else (text, [])
    if not calls and tool_use.active and r.finish_reason == "length":
        content, cut = _cut_calls(tool_use, text)
        if cut:
            return {**message, "content": content, "tool_calls": cut}, r.finish_reason
    if not calls:
        return message, r.finish_reason
    reason = "tool_calls" if r.finish_reason == "stop" else r.finish_reason
    return {**message, "content": content, "tool_calls": [c.openai() for c in calls]}, reason


def _cut_calls(tool_use: ToolUse, text: str) -> tuple[str | None, list[dict]]:
    """A text that max_tokens cut inside a call, read as the stream reads it: a call whose name was
    written is a call, its arguments as far as they got (as OpenAI answers; a streaming client
    assembles the same), so the answer does not depend on `stream`."""
    parser = tool_use.stream()
    content, calls = "", {}
    for p in parser.feed(text) + parser.finish():
        if p.content is not None:
            content += p.content
        elif p.name is not None:
            calls[p.index] = {"id": p.call_id, "type": "function", "function": {"name": p.name,
                                                                                "arguments": p.arguments or ""}}
        else:
            calls[p.index]["function"]["arguments"] += p.arguments or ""
    return content or None, list(calls.values())


def _tool_delta(p: Piece) -> dict:
    """A parser piece as an OpenAI chunk delta: content, a call's header, or a piece of its arguments."""
    if p.content is not None:
        return {"content": p.content}
    call: dict = {"index": p.index, "function": {"arguments": p.arguments or ""}}
    if p.name is not None:
        call = {"index": p.index, "id": p.call_id, "type": "function",
                "function": {"name": p.name, "arguments": p.arguments or ""}}
    return {"tool_calls": [call]}


# --- /v1/completions ------------------------------------------------------------------------------
def _prompts(value, served: ServedModel) -> list[list[int]]:
    tok = served.engine.tokenizer
    if isinstance(value, str):
        return [encode_prompt(tok, value)]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return [encode_prompt(tok, p) for p in value]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [check_token_ids(value, tok.vocab_size, "prompt")]
        if all(isinstance(p, list) for p in value):
            return [check_token_ids(p, tok.vocab_size, "prompt") for p in value]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                      "prompt")


async def completions(request: Request) -> Response:
    body = await read_json(request)
    served = await model_for(request, get_model_name(body))
    body = profiles.openai_body(body, served.profile)
    echo = bool(get_bool(body, "echo", False))
    # echo with max_tokens 0 scores the prompt and generates nothing (OpenAI's legacy way to ask for a
    # text's logprobs): the engine samples one token, which the response leaves out.
    score_only = echo and body.get("max_tokens") == 0
    opts = parse_options({**body, "max_tokens": 1} if score_only else body, chat=False)
    if get_str(body, "suffix"):
        raise bad_request("suffix: this model does not support fill-in-the-middle", "suffix")
    best_of = get_int(body, "best_of", lo=1)
    if best_of is not None and best_of != opts.n:
        raise bad_request(f"best_of is not supported (use n): it may only equal n ({opts.n}), got {best_of}", "best_of")
    if echo and opts.params.logprobs:
        opts.params.prompt_logprobs = opts.params.top_logprobs
    if body.get("prompt") is None:
        raise bad_request("prompt is required", "prompt")
    constraint = openai_spec(body)
    prompts = await off_loop(lambda: _prompts(body["prompt"], served), chars_in(body["prompt"]))
    tok = served.engine.tokenizer
    await add_constraint(opts.params, tok, constraint)
    env = Envelope("text_completion", served.name, opts.include_usage)

    scores_prompt = opts.params.prompt_logprobs is not None

    def prefix(g: Generation) -> str:
        return tok.decode(g.prompt_ids, skip_special_tokens=True) if echo else ""

    def logprobs_of(ids_, lps, top, offset):
        if score_only or not opts.params.logprobs or not ids_:
            return None
        return completion_logprobs(tok, ids_, lps, top, offset)

    def prompt_logprobs_of(g: Generation, scores) -> dict:
        return echo_logprobs(tok, g.prompt_ids, scores, opts.params.top_logprobs > 0)

    async def stream_body(gens: list[Generation]):
        by_choice = _by_choice(gens)  # once per stream, not per token
        offsets = [len(prefix(g)) for g in by_choice]
        counts = [0] * len(offsets)
        unechoed = set(range(len(offsets))) if echo else set()
        if echo and not scores_prompt:  # the prompt's chunk goes first; with its logprobs, once they exist
            for i, g in enumerate(by_choice):
                unechoed.discard(i)
                yield env.wrap([{"index": i, "text": prefix(g), "logprobs": None, "finish_reason": None}],
                               usage=_running_usage(opts, g, 0))
        async for i, d in all_deltas(gens):
            if i in unechoed and (d.prompt_logprobs is not None or d.finished):
                unechoed.discard(i)
                g = by_choice[i]
                yield env.wrap([{"index": i, "text": prefix(g), "finish_reason": None,
                                 "logprobs": prompt_logprobs_of(g, d.prompt_logprobs)}],
                               usage=_running_usage(opts, g, counts[i]))
            if score_only:
                d = replace(d, text="", token_ids=[])
            counts[i] += len(d.token_ids)
            lp = logprobs_of(d.token_ids, d.logprobs, d.top_logprobs, offsets[i])
            offsets[i] += len(d.text)
            if d.text or lp or d.finished:
                yield env.wrap([{"index": i, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}],
                               usage=_running_usage(opts, by_choice[i], counts[i]))
        if opts.include_usage:
            yield env.wrap([], usage=_total_usage(gens, counts))

    def finish_body(gens: list[Generation], results: list[Result]) -> dict:
        choices = []
        for i, (g, r) in enumerate(zip(_by_choice(gens), results)):
            head = prefix(g)
            text, ids_ = ("", []) if score_only else (r.text, r.token_ids)
            lp = logprobs_of(ids_, r.logprobs, r.top_logprobs, len(head))
            if scores_prompt:
                lp = joined_logprobs(prompt_logprobs_of(g, r.prompt_logprobs), lp)
            choices.append({"index": i, "text": head + text, "finish_reason": r.finish_reason, "logprobs": lp})
        u = _total_usage(gens, [0 if score_only else len(r.token_ids) for r in results])
        return env.wrap(choices, usage=u)

    return await respond(request, lambda: generations(served, prompts, opts, "prompt"), opts,
                         opts.n * len(prompts), stream_body, finish_body)


# --- /v1/models -----------------------------------------------------------------------------------
def _model_card(request: Request, e: model_info.ModelEntry, host: ModelHost) -> dict:
    """OpenAI's model object, or Anthropic's for its SDK (which says so in a header)."""
    served = next((m for m in host.loaded_models() if m.path == e.path), None)
    max_len = served.engine.max_model_len if served is not None else None
    if anthropic_models.wants_anthropic(request):
        return anthropic_models.model_card(e, max_len)
    card = {"id": e.name, "object": "model", "created": int(e.modified_at), "owned_by": "tokenmill"}
    if max_len is not None:
        card["max_model_len"] = max_len
    return card


async def list_models(request: Request) -> Response:
    host = _host(request)
    entries = await run_in_threadpool(model_info.installed_entries, host)
    cards = [_model_card(request, e, host) for e in entries]
    if anthropic_models.wants_anthropic(request):
        return JSONResponse(anthropic_models.model_list(cards))
    return JSONResponse({"object": "list", "data": cards})


async def get_model(request: Request) -> Response:
    host = _host(request)
    name = check_name_field(request.path_params["model"], "model")
    entry = await run_in_threadpool(model_info.find_entry, host, name)
    if entry is None:
        raise APIError(404, f"model {name!r} not found", param="model", code="model_not_found")
    return JSONResponse(_model_card(request, entry, host))


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    ]
