"""What each API's streamed answer looks like to the load generator: the body of one request
(`ApiOptions.body`) and the reading of each line of its stream into a RequestResult: OpenAI's SSE
chunks (`data: {...}`, then `data: [DONE]`), Ollama's NDJSON objects (the last with `done: true`),
and Anthropic's typed events (`event: X` / `data: {...}`, ending with `message_stop`)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

APIS = ("openai", "ollama", "anthropic")


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    start: float = 0.0            # perf_counter at send
    end: float = 0.0
    ttft: float | None = None
    first_event: float | None = None  # first chunk standing for a token, even one with no text
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with text
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # OpenAI usage.prompt_tokens_details.cached_tokens, if sent
    tokens_from_server: bool = False
    prompt_from_server: bool = False
    text: str = ""

    @property
    def e2e(self) -> float:
        return self.end - self.start

    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class ApiOptions:
    api: str = "openai"           # openai | ollama | anthropic
    chat: bool = False            # /v1/chat/completions or /api/chat instead of the completion endpoint
    model: str = ""
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int | None = None
    raw: bool = True              # Ollama /api/generate: send the prompt untemplated
    extra: dict = field(default_factory=dict)  # merged into every request body

    def endpoint(self) -> str:
        if self.api == "anthropic":
            return "/v1/messages"  # chat only
        if self.api == "openai":
            return "/v1/chat/completions" if self.chat else "/v1/completions"
        return "/api/chat" if self.chat else "/api/generate"

    def body(self, prompt: str, max_tokens: int) -> dict:
        if self.api == "ollama":
            # Ollama has no ignore_eos: num_predict caps the output, EOS may end it earlier.
            b: dict[str, Any] = {"model": self.model, "stream": True,
                                 "options": {"num_predict": max_tokens, "temperature": self.temperature}}
            if self.seed is not None:
                b["options"]["seed"] = self.seed
            if not self.chat and self.raw:
                b["raw"] = True
        else:
            b = {"model": self.model, "max_tokens": max_tokens, "temperature": self.temperature, "stream": True}
            if self.api == "openai":
                b["stream_options"] = {"include_usage": True}
            if self.ignore_eos:  # vLLM's extensions (llama.cpp and tokenmill take them too)
                b["ignore_eos"] = True
                b["min_tokens"] = max_tokens
            if self.seed is not None:
                b["seed"] = self.seed
        if self.chat or self.api == "anthropic":
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        b.update(self.extra)
        return b


def error_text(obj: Any) -> str:
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(obj)


def _text_arrived(res: RequestResult, text: str, now: float) -> None:
    res.chunk_times.append(now)
    res.text += text
    if res.ttft is None:
        res.ttft = now - res.start


def take_openai(obj: dict, res: RequestResult, chat: bool, now: float) -> None:
    if obj.get("error") is not None:
        raise RuntimeError(error_text(obj))
    for ch in obj.get("choices") or []:
        text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
        if res.first_event is None and (text or ch.get("finish_reason") or not chat):
            res.first_event = now  # (a chat stream's first chunk only announces the role)
        if text:
            _text_arrived(res, text, now)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if usage.get("completion_tokens") is not None:
            res.output_tokens, res.tokens_from_server = int(usage["completion_tokens"]), True
        if usage.get("prompt_tokens") is not None:
            res.prompt_tokens, res.prompt_from_server = int(usage["prompt_tokens"]), True
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            res.cached_tokens = int(details["cached_tokens"])


def take_ollama(obj: dict, res: RequestResult, chat: bool, now: float) -> bool:
    """True when this was the final object."""
    if obj.get("error") is not None:
        raise RuntimeError(error_text(obj))
    text = (obj.get("message") or {}).get("content") if chat else obj.get("response")
    if res.first_event is None:
        res.first_event = now
    if text:
        _text_arrived(res, text, now)
    if obj.get("done"):
        if obj.get("eval_count") is not None:
            res.output_tokens, res.tokens_from_server = int(obj["eval_count"]), True
        if obj.get("prompt_eval_count") is not None:
            res.prompt_tokens, res.prompt_from_server = int(obj["prompt_eval_count"]), True
        return True
    return False


def take_anthropic(obj: dict, res: RequestResult, now: float) -> bool:
    """One Messages API event; True at message_stop. The prompt's tokens are input_tokens plus the
    prefix cache's share (cache_read_input_tokens), as message_delta's cumulative usage has them."""
    kind = obj.get("type")
    if kind == "error":
        raise RuntimeError(error_text(obj))
    if kind in ("content_block_delta", "message_delta") and res.first_event is None:
        res.first_event = now
    if kind == "content_block_delta":
        text = (obj.get("delta") or {}).get("text")
        if text:
            _text_arrived(res, text, now)
    elif kind == "message_delta" and isinstance(obj.get("usage"), dict):
        usage = obj["usage"]
        if usage.get("output_tokens") is not None:
            res.output_tokens, res.tokens_from_server = int(usage["output_tokens"]), True
        if usage.get("input_tokens") is not None:
            cached = int(usage.get("cache_read_input_tokens") or 0)
            res.prompt_tokens, res.prompt_from_server = int(usage["input_tokens"]) + cached, True
            res.cached_tokens = cached
    return kind == "message_stop"


def take_line(opts: ApiOptions, line: str, res: RequestResult, now: float) -> bool:
    """One line of a streamed answer read into res; True when the stream is complete."""
    if opts.api == "ollama":
        return take_ollama(json.loads(line), res, opts.chat, now)
    if not line.startswith("data:"):
        return False  # SSE comments / event names
    data = line[5:].strip()
    if opts.api == "anthropic":
        return take_anthropic(json.loads(data), res, now)
    if data == "[DONE]":
        return True
    take_openai(json.loads(data), res, opts.chat, now)
    return False
