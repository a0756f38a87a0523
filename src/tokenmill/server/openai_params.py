"""OpenAI request bodies -> SamplingParams (plus n, streaming and priority), including vLLM's
extensions (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, ...). OpenAI's own defaults
apply: temperature 1, top_p 1, no top_k, no repetition penalty."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine import Priority, SamplingParams
from tokenmill.engine.sampling_params import MAX_SPECULATIVE_TOKENS
from tokenmill.server.errors import bad_request, shown_value
from tokenmill.server.logit_bias import openai_logit_bias
from tokenmill.server.structured_params import OPENAI_FIELDS
from tokenmill.server.validation import (
    get_bool,
    get_dict,
    get_float,
    get_int,
    get_priority,
    get_stop,
    get_str,
    warn_unknown,
)

MAX_N = 128
# OpenAI's (and vLLM's) default max_tokens for the legacy /v1/completions; chat has none (to the
# context's end). An explicit null means no limit there too, as in vLLM.
COMPLETIONS_MAX_TOKENS = 16

SAMPLING_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logprobs", "priority", "user", "logit_bias",
    # vLLM / llama.cpp extensions
    "top_k", "min_p", "typical_p", "repetition_penalty", "repeat_last_n", "min_tokens", "ignore_eos",
    "stop_token_ids", "truncate_prompt_tokens", "include_stop_str_in_output",
    "speculative", "num_speculative_tokens",  # tokenmill's: speculative decoding per request
    *OPENAI_FIELDS,  # response_format, vLLM's guided_* and structured_outputs
}
# Accepted without effect: they change nothing about the text a model can produce here (`modalities`
# may only ask for text, see refuse_unsupported).
HARMLESS = {"user", "store", "metadata", "service_tier", "safety_identifier",
            "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
            "modalities", "verbosity"}
# Asked for, these would change what the client gets back in a way this server cannot honour (audio, a
# legacy function call, a web search): a 400 naming the field, never a silently different answer.
REFUSED_CHAT = {"audio", "functions", "function_call", "web_search_options"}
CHAT_FIELDS = SAMPLING_FIELDS | HARMLESS | REFUSED_CHAT | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "reasoning_effort",
    "prediction"}  # predicted outputs: server/predicted_outputs.py
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# Names chat_template_kwargs may not use: the renderer's own arguments, set by the request's own fields.
RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "continue_final_message"}
COMPLETION_FIELDS = SAMPLING_FIELDS | HARMLESS | {"prompt", "echo", "suffix", "best_of"}


@dataclass
class OpenAIOptions:
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    priority: Priority
    truncate_prompt_tokens: int | None
    field_names: dict[str, str]


def parse_options(body: dict, *, chat: bool) -> OpenAIOptions:
    warn_unknown(body, CHAT_FIELDS if chat else COMPLETION_FIELDS,
                 "/v1/chat/completions" if chat else "/v1/completions")
    names: dict[str, str] = {"repeat_penalty": "repetition_penalty"}
    get_str(body, "user")  # unused here, but a string as OpenAI and vLLM require (400 otherwise)
    max_tokens = get_int(body, "max_tokens", None if chat or "max_tokens" in body else COMPLETIONS_MAX_TOKENS)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = get_int(body, "max_completion_tokens")
        names["max_tokens"] = "max_completion_tokens"
    if chat:
        want_logprobs = bool(get_bool(body, "logprobs", False))
        top = get_int(body, "top_logprobs", 0)
        if top and not want_logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    else:
        # Legacy completions: logprobs is the number of alternatives (0 = only the chosen token).
        top = get_int(body, "logprobs")
        want_logprobs = top is not None
        top = top or 0
        names["top_logprobs"] = "logprobs"
    top_k = get_int(body, "top_k", 0)
    stream = bool(get_bool(body, "stream", False))
    stream_options = get_dict(body, "stream_options")
    if body.get("stream_options") is not None and not stream:
        # As OpenAI and vLLM: the options of a stream, with no stream to apply them to.
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if get_bool(body, "include_stop_str_in_output", False):
        # vLLM's: the matched stop string kept in the output. Refused rather than ignored.
        raise bad_request("include_stop_str_in_output is not supported: the stop string that ended the "
                          "output is never part of it", "include_stop_str_in_output")
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=get_int(body, "min_tokens", 0),
        temperature=get_float(body, "temperature", 1.0),
        top_k=0 if top_k < 0 else top_k,  # vLLM uses -1 for "off"
        top_p=get_float(body, "top_p", 1.0),
        min_p=get_float(body, "min_p", 0.0),
        typical_p=get_float(body, "typical_p", 1.0),
        repeat_penalty=get_float(body, "repetition_penalty", 1.0),
        repeat_last_n=get_int(body, "repeat_last_n", 64),
        presence_penalty=get_float(body, "presence_penalty", 0.0),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0),
        seed=get_int(body, "seed"),
        stop=get_stop(body),
        stop_token_ids=body.get("stop_token_ids") or [],
        ignore_eos=bool(get_bool(body, "ignore_eos", False)),
        logprobs=want_logprobs,
        top_logprobs=top,
        speculative=get_bool(body, "speculative", None),
        num_speculative_tokens=get_int(body, "num_speculative_tokens", lo=0, hi=MAX_SPECULATIVE_TOKENS),
        logit_bias=openai_logit_bias(body),
    )
    truncate = get_truncate(body)
    include_usage = stream and bool(get_bool(stream_options, "include_usage", False,
                                             label="stream_options.include_usage"))
    continuous = bool(get_bool(stream_options, "continuous_usage_stats", False,
                               label="stream_options.continuous_usage_stats"))
    return OpenAIOptions(
        params=params,
        n=get_int(body, "n", 1, lo=1, hi=MAX_N),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and continuous,  # as vLLM: only along with include_usage
        priority=get_priority(body),
        truncate_prompt_tokens=truncate,
        field_names=names,
    )


def refuse_unsupported(body: dict) -> None:
    """A 400 for a chat request that asks for what this server cannot give (see REFUSED_CHAT)."""
    for name in ("functions", "function_call"):
        value = body.get(name)
        # function_call "auto" / "none" without functions asks for nothing; a named one or a list does.
        if value not in (None, [], "auto", "none"):
            raise bad_request(f"{name} (OpenAI's deprecated function calling) is not supported: send the functions "
                              "as tools and function_call as tool_choice", name)
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list)
                                   or not all(isinstance(m, str) for m in modalities)):
        raise bad_request("modalities must be a list of strings", "modalities")
    if body.get("audio") is not None or (modalities and "audio" in modalities):
        field = "audio" if body.get("audio") is not None else "modalities"
        raise bad_request(f"{field}: audio output is not supported, this server writes text only", field)
    if body.get("web_search_options") is not None:
        raise bad_request("web_search_options: this server has no web search", "web_search_options")


def template_options(body: dict) -> dict:
    """The chat template's arguments a request may set: vLLM's add_generation_prompt (false: the
    prompt ends with the last message's turn closed) and continue_final_message (the last, assistant,
    message left open for the model to go on writing: an assistant prefill), and chat_template_kwargs,
    variables the template reads (Qwen3's enable_thinking, documents, ...)."""
    extra = get_dict(body, "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {shown_value(effort)}",
                          "reasoning_effort")
    if effort == "none" and "enable_thinking" not in extra:
        # OpenAI's "no reasoning", as Ollama maps it: a thinking model's template with thinking off. The
        # other levels leave the model's default (it thinks; how much is not a setting these models have).
        extra = {**extra, "enable_thinking": False}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
    if reserved:
        raise bad_request(f"chat_template_kwargs.{reserved[0]} cannot be set there; it comes from the request's "
                          "own fields", "chat_template_kwargs")
    continue_final = bool(get_bool(body, "continue_final_message", False))
    if continue_final and get_bool(body, "add_generation_prompt", False):
        # As vLLM: a new turn opened after the message that is to be continued is a contradiction.
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    return {**extra, "add_generation_prompt": bool(get_bool(body, "add_generation_prompt", not continue_final)),
            "continue_final_message": continue_final}


def get_truncate(body: dict) -> int | None:
    """vLLM's truncate_prompt_tokens: k > 0 or -1; 0 would keep nothing (a slice [-0:] keeps all)."""
    truncate = get_int(body, "truncate_prompt_tokens", lo=-1)
    if truncate == 0:
        raise bad_request("truncate_prompt_tokens must be positive, or -1 for the context size",
                          "truncate_prompt_tokens")
    return truncate


def truncate_prompt(ids: list[int], truncate: int | None, limit: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: as many as the context allows)."""
    if truncate is None:
        return ids
    keep = limit - 1 if truncate == -1 else truncate
    return ids[-keep:] if len(ids) > keep else ids
