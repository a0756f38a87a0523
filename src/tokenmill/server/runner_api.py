"""The runner endpoints, shaped like llama-server's (and Ollama's runner): /load, /health,
/completion, /embedding, /tokenize, /detokenize."""
from __future__ import annotations

from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenmill import kernels
from tokenmill.config import Config
from tokenmill.engine import ConfigError, SamplingParams
from tokenmill.engine.output import TextDelta
from tokenmill.server.chat import chars_in, check_token_ids, encode_prompt, normalize_messages, off_loop, render_chat
from tokenmill.server.embedding import embed, embedding_limit, fit_to_context
from tokenmill.server.errors import APIError, bad_request, client_safe, shown_value
from tokenmill.server.generation import Generation, Result, all_deltas
from tokenmill.server.logit_bias import runner_logit_bias
from tokenmill.server.logprobs import token_bytes, token_text
from tokenmill.server.model_host import LoadSpec, ModelHost, model_for
from tokenmill.server.streaming import sse_response, unless_disconnected
from tokenmill.server.structured_params import RUNNER_FIELDS, add_constraint, runner_spec
from tokenmill.server.validation import (
    get_bool,
    get_float,
    get_int,
    get_model_name,
    get_priority,
    get_stop,
    get_str,
    read_json,
    warn_unknown,
)

LOAD_FIELDS = {"model", "num_ctx", "kv_size", "parallel", "batch_size", "ubatch_size", "dtype"}
COMPLETION_FIELDS = {"prompt", "n_predict", "temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty",
                     "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "stop", "stream", "n_probs",
                     "ignore_eos", "min_tokens", "priority", "cache_prompt", "id_slot", "model", "logit_bias",
                     *RUNNER_FIELDS}
EMBEDDING_FIELDS = {"content", "input", "model", "truncate"}
TOKENIZE_FIELDS = {"content", "prompt", "messages", "model", "add_special", "add_special_tokens",
                   "add_generation_prompt", "with_pieces"}
DETOKENIZE_FIELDS = {"tokens", "model"}
# llama-server's names for SamplingParams fields, for error messages.
FIELD_NAMES = {"max_tokens": "n_predict", "top_logprobs": "n_probs"}


def _host(request: Request) -> ModelHost:
    return request.app.state.host


DTYPE_CHOICES = ("auto", "gguf", "bf16", "fp32")


# --- /load and /health ----------------------------------------------------------------------------
async def load(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, LOAD_FIELDS, "/load")
    host = _host(request)
    settings: Config = request.app.state.settings
    current = host.current
    model = get_model_name(body) or (current.spec.model if current else None)
    if not model:
        raise bad_request("model is required", "model")
    dtype = get_str(body, "dtype", settings.dtype)
    if dtype not in DTYPE_CHOICES:
        raise bad_request(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {shown_value(dtype)}", "dtype")
    # The server's configuration, with what the body overrides.
    engine = replace(
        settings.engine_config(),
        dtype=dtype,
        max_model_len=get_int(body, "num_ctx", settings.num_ctx or None, lo=2),
        max_total_tokens=get_int(body, "kv_size", settings.kv_size, lo=16),
        parallel=get_int(body, "parallel", settings.parallel, lo=1),
        n_batch=get_int(body, "batch_size", settings.n_batch, lo=1),
        n_ubatch=get_int(body, "ubatch_size", settings.n_ubatch, lo=1),
    )
    try:
        engine.validate()
    except ConfigError as exc:
        raise bad_request(str(exc)) from None
    spec = LoadSpec(model, engine)
    _check_model_exists(model)
    host.start_load(spec)
    return JSONResponse({"status": "loading", "model": model}, status_code=202)


def _check_model_exists(model: str) -> None:
    """A typo'd name is a 404 now rather than an error status later; pulls and loads run behind."""
    from tokenmill.store import ModelNotInstalledError, UnknownModelError, resolve_model

    try:
        resolve_model(model)
    except ModelNotInstalledError:
        pass  # known to the catalog: the load pulls it
    except UnknownModelError as exc:
        raise APIError(404, str(exc), param="model") from None


async def health(request: Request) -> Response:
    host = _host(request)
    status = host.status
    if status == "ok":
        return JSONResponse({"status": "ok", "kernels": kernels.variant()})
    if status == "loading":
        return JSONResponse({"status": "loading", "progress": round(host.progress, 3)}, status_code=503)
    if status == "error":
        return JSONResponse({"status": "error", "error": client_safe(host.problem)}, status_code=503)
    return JSONResponse({"status": "error", "error": "no model loaded"}, status_code=503)


# --- /completion --------------------------------------------------------------------------------
def _params(body: dict, tok) -> SamplingParams:
    n_predict = get_int(body, "n_predict", -1, lo=-2)
    seed = get_int(body, "seed", -1)
    n_probs = get_int(body, "n_probs", 0, lo=0)
    top_k = get_int(body, "top_k", 40)
    return SamplingParams(  # llama-server's defaults
        # n_predict 0 (evaluate the prompt into the cache, generate nothing): the engine makes the one
        # token a prompt's last step samples anyway, and the answer leaves it out (_evaluate_only).
        max_tokens=n_predict if n_predict > 0 else 1 if n_predict == 0 else None,
        min_tokens=get_int(body, "min_tokens", 0),
        temperature=get_float(body, "temperature", 0.8),
        top_k=max(top_k, 0),
        top_p=get_float(body, "top_p", 0.95),
        min_p=get_float(body, "min_p", 0.05),
        typical_p=get_float(body, "typical_p", 1.0),
        repeat_penalty=get_float(body, "repeat_penalty", 1.0),
        repeat_last_n=get_int(body, "repeat_last_n", 64),
        presence_penalty=get_float(body, "presence_penalty", 0.0),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0),
        seed=seed if seed >= 0 else None,
        stop=get_stop(body),
        ignore_eos=bool(get_bool(body, "ignore_eos", False)),
        logprobs=n_probs > 0,
        top_logprobs=n_probs,
        logit_bias=runner_logit_bias(body, lambda text: tok.encode(text, add_special_tokens=False)),
    )


def sampling_defaults(tok) -> dict:
    """What a /completion with no sampling fields uses, as llama-server's /props lists it."""
    p = _params({}, tok)
    return {"n_predict": -1, "seed": -1, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
            "min_p": p.min_p, "typical_p": p.typical_p, "repeat_penalty": p.repeat_penalty,
            "repeat_last_n": p.repeat_last_n, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty, "n_probs": 0, "ignore_eos": False,
            "stop": []}


def _stop_type(finish_reason: str | None, stopping_word: str | None) -> str:
    if stopping_word is not None:
        return "word"
    return "limit" if finish_reason == "length" else "eos"


def _probs(gen: Generation, ids: list[int], lps, top) -> list[dict]:
    tok = gen.served.engine.tokenizer
    return [{"id": t, "token": token_text(tok, t), "logprob": lps[i] if lps else 0.0,
             "top_logprobs": [{"id": a, "token": token_text(tok, a), "logprob": lp} for a, lp in (top[i] if top else [])]}
            for i, t in enumerate(ids)]


def _final(gen: Generation, text: str, finish_reason: str | None, stopping_word: str | None,
           num_output: int) -> dict:
    """The last object of a completion; `stopping_word`: the stop string that ended it, if one did."""
    t = gen.timings
    end = t.finish_time()
    submitted = t.submitted or end
    first = t.first_token or end
    prompt_ms, predicted_ms = (first - submitted) * 1000, (end - first) * 1000
    return {
        "content": text, "stop": True, "model": gen.served.name, "tokens_predicted": num_output,
        "tokens_evaluated": gen.num_prompt_tokens, "tokens_cached": gen.num_cached_tokens, "truncated": False,
        "stop_type": _stop_type(finish_reason, stopping_word), "stopping_word": stopping_word or "",
        "timings": {"prompt_n": gen.num_prompt_tokens, "prompt_ms": prompt_ms,
                    "predicted_n": num_output, "predicted_ms": predicted_ms,
                    "predicted_per_second": num_output / predicted_ms * 1000 if predicted_ms > 0 else 0.0},
    }


async def completion(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, COMPLETION_FIELDS, "/completion")
    host = _host(request)
    served = await model_for(request, get_model_name(body))
    tok = served.engine.tokenizer
    prompts = await off_loop(lambda: _prompts(body.get("prompt"), tok), chars_in(body.get("prompt")))
    # Accepted as llama-server's, though they change nothing here: the prefix cache is always on and
    # there are no slots to pick; still type-checked, so a wrong value is not silently taken.
    get_bool(body, "cache_prompt")
    get_int(body, "id_slot", lo=-1)
    # logit_bias may name tokens by their text, tokenized here: a long one off the event loop.
    params = await off_loop(lambda: _params(body, tok), chars_in(body.get("logit_bias")))
    evaluate_only = body.get("n_predict") == 0
    await add_constraint(params, tok, runner_spec(body))
    stream = bool(get_bool(body, "stream", False))
    priority = get_priority(body)
    slot = host.admission.enter(len(prompts))  # each prompt is a sequence of its own
    try:
        gens = [Generation(served, ids, params, priority=priority, field_names=FIELD_NAMES) for ids in prompts]
        multi = len(gens) > 1
        if stream:
            # The response owns the slot from here: it is released when the stream ends, however it ends.
            response, slot = sse_response(_stream(gens, evaluate_only), on_close=slot.release, done_marker=False), None
            return response
        results = await unless_disconnected(request, _collect(gens, evaluate_only))
    finally:
        if slot is not None:
            slot.release()
    # llama-server: one prompt answers one object, several an array of them (each with its index).
    return JSONResponse(results if multi else results[0])


def _prompts(prompt, tok) -> list[list[int]]:
    """llama-server's prompt forms: a string, token ids, or a mix of both ([12, "text", 34], one
    prompt); or a list of such prompts, each completed on its own."""
    if isinstance(prompt, str) or _is_mixed(prompt):
        return [_mixed_ids(prompt, tok)]
    if _is_token_ids(prompt):
        return [check_token_ids(prompt, tok.vocab_size, "prompt")]
    if isinstance(prompt, list) and prompt:
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, str) or _is_mixed(p):
                out.append(_mixed_ids(p, tok, f"prompt[{i}]"))
            elif _is_token_ids(p):
                out.append(check_token_ids(p, tok.vocab_size, f"prompt[{i}]"))
            else:
                raise bad_request(f"prompt[{i}] must be a string, a list of token ids, or a list of strings and "
                                  "token ids", f"prompt[{i}]")
        return out
    raise bad_request("prompt must be a string, a list of token ids, a list of strings and token ids, "
                      "or a list of such prompts", "prompt")


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _is_mixed(value) -> bool:
    """Strings and token ids in one list: one prompt (llama-server needs at least one of each)."""
    return (isinstance(value, list) and all(isinstance(t, (int, str)) and not isinstance(t, bool) for t in value)
            and any(isinstance(t, str) for t in value) and any(isinstance(t, int) for t in value))


def _mixed_ids(prompt, tok, field: str = "prompt") -> list[int]:
    """As llama-server's tokenize_mixed: the special tokens (BOS) only before a leading string."""
    if isinstance(prompt, str):
        return encode_prompt(tok, prompt)
    ids: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            ids += encode_prompt(tok, part) if i == 0 else tok.encode(part, add_special_tokens=False)
        else:
            ids.append(part)
    return check_token_ids(ids, tok.vocab_size, field)


def _indexed(obj: dict, index: int) -> dict:
    return {**obj, "index": index}  # which prompt, as llama-server says in every object


def _evaluate_only(d: TextDelta) -> TextDelta:
    """n_predict 0: the prompt was evaluated; the token sampled with its last step is not an answer,
    so the request ends at its limit (an error or abort still says so)."""
    reason = "length" if d.finish_reason in ("stop", "length") else d.finish_reason
    return replace(d, text="", token_ids=[], logprobs=None, top_logprobs=None, stop_string=None,
                   finish_reason=reason, num_output_tokens=0)


async def _stream(gens: list[Generation], evaluate_only: bool = False):
    counts = [0] * len(gens)
    async for p, d in all_deltas(gens):
        d = _evaluate_only(d) if evaluate_only else d
        gen = gens[p]
        counts[p] += len(d.token_ids)
        chunk = _indexed({"content": d.text, "stop": False, "tokens": d.token_ids}, p)
        if gen.params.logprobs:
            chunk["completion_probabilities"] = _probs(gen, d.token_ids, d.logprobs, d.top_logprobs)
        if d.finished:
            if d.text or d.token_ids:
                yield chunk
            yield _indexed(_final(gen, "", d.finish_reason, d.stop_string, counts[p]), p)
        elif d.text or d.token_ids:
            yield chunk


async def _collect(gens: list[Generation], evaluate_only: bool = False) -> list[dict]:
    results = [Result() for _ in gens]
    stopping = [None] * len(gens)
    async for p, d in all_deltas(gens):
        d = _evaluate_only(d) if evaluate_only else d
        results[p].add(d)
        stopping[p] = stopping[p] or d.stop_string
    out = []
    for p, (gen, r) in enumerate(zip(gens, results)):
        obj = _final(gen, r.text, r.finish_reason, stopping[p], len(r.token_ids))
        obj["tokens"] = r.token_ids
        if gen.params.logprobs:
            obj["completion_probabilities"] = _probs(gen, r.token_ids, r.logprobs, r.top_logprobs)
        out.append(_indexed(obj, p))
    return out


# --- /embedding, /tokenize, /detokenize ---------------------------------------------------------
async def embedding(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, EMBEDDING_FIELDS, "/embedding")
    host = _host(request)
    served = await model_for(request, get_model_name(body))
    text = get_str(body, "content") if body.get("content") is not None else get_str(body, "input", label="content")
    if not text:
        raise bad_request("content is required", "content")
    encoded = await off_loop(lambda: encode_prompt(served.engine.tokenizer, text), len(text))
    ids = fit_to_context(encoded, embedding_limit(served),
                         bool(get_bool(body, "truncate", False)), "content")
    slot = host.admission.enter()
    try:
        vector = await embed(served, ids)
    finally:
        slot.release()
    return JSONResponse({"embedding": vector})


async def tokenize(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, TOKENIZE_FIELDS, "/tokenize")
    served = await model_for(request, get_model_name(body))
    tok = served.engine.tokenizer
    if body.get("messages") is not None:
        messages = normalize_messages(body["messages"])
        add_prompt = bool(get_bool(body, "add_generation_prompt", True))
        ids = await off_loop(lambda: render_chat(tok, messages, add_generation_prompt=add_prompt), chars_in(messages))
    else:
        text = get_str(body, "content") if "content" in body else get_str(body, "prompt", label="content")
        if text is None:
            raise bad_request("content (or prompt, or messages) is required", "content")
        add = get_bool(body, "add_special", None)
        add = get_bool(body, "add_special_tokens", True) if add is None else add
        ids = await off_loop(lambda: tok.encode(text, add_special_tokens=bool(add)), len(text))
    if get_bool(body, "with_pieces", False):
        # llama-server: each token with its text, or its bytes where those are not whole UTF-8.
        ids = [{"id": t, "piece": _piece(tok, t)} for t in ids]
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": served.engine.max_model_len})


def _piece(tok, token_id: int) -> str | list[int]:
    raw = bytes(token_bytes(tok, token_id))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def detokenize(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, DETOKENIZE_FIELDS, "/detokenize")
    served = await model_for(request, get_model_name(body))
    tok = served.engine.tokenizer
    ids = check_token_ids(body.get("tokens"), tok.vocab_size, "tokens")
    text = tok.decode(ids)
    return JSONResponse({"content": text, "prompt": text})


def routes() -> list[Route]:
    return [
        Route("/load", load, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/completion", completion, methods=["POST"]),
        Route("/completions", completion, methods=["POST"]),  # llama-server's alias
        Route("/embedding", embedding, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
