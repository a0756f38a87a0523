"""Prompt building shared by the APIs: chat messages in the shapes clients send them, rendered with
the model's own chat template, and plain prompts with an optional system message. Every route builds
its prompts through `off_loop`, so a huge input is tokenized on a worker thread."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

from tokenmill.server.errors import bad_request, shown_value
from tokenmill.server.tool_messages import check_tool_parts
from tokenmill.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

T = TypeVar("T")

# Inputs up to this many characters are built inline: they tokenize in about a millisecond or less,
# where a hop to a worker thread and back costs ~80 µs plus a turn of the loop for every request.
INLINE_CHARS = 2048

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


# Parts that hold text, and the key it is under: OpenAI's text part, the Responses API's input_text, and
# an assistant's refusal (which a client sends back as it got it), as vLLM reads them.
_TEXT_PARTS = {"text": "text", "input_text": "text", "refusal": "refusal"}
_MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file")


def _content_text(content: Any, where: str) -> str | None:
    """OpenAI allows a string or a list of typed parts; only text parts are meaningful here."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _TEXT_PARTS and isinstance(part.get(_TEXT_PARTS[kind]), str):
                texts.append(part[_TEXT_PARTS[kind]])
            elif kind in _MEDIA_PARTS:
                raise bad_request(f"{where}[{j}]: this model accepts text only, got a part of type {kind}",
                                  f"{where}")
            else:
                raise bad_request(f"{where}[{j}] must be a text part ({{\"type\": \"text\", \"text\": ...}})", where)
        return "".join(texts)
    raise bad_request(f"{where} must be a string or a list of content parts", where)


def normalize_messages(messages: Any, field: str = "messages", *, text_arguments: bool = True) -> list[dict]:
    """Messages as templates take them; a 400 naming the first bad part. `text_arguments`: a past
    tool call's arguments may be JSON text (OpenAI), not only an object (Ollama)."""
    if not isinstance(messages, list):
        raise bad_request(f"{field} must be a list of messages", field)
    out = []
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(sorted(_ROLES))}, got {shown_value(role)}",
                              f"{where}.role")
        if m.get("images"):
            raise bad_request(f"{where}.images: this model accepts text only", f"{where}.images")
        msg = {k: v for k, v in m.items() if k not in ("content", "images")}
        # "developer" is OpenAI's newer name for "system"; templates only know the latter.
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = _content_text(m.get("content"), f"{where}.content") or ""
        out.append(check_tool_parts(msg, where, text_arguments=text_arguments))
    return out


def render_chat(tokenizer: Tokenizer, messages: list[dict], *, tools: list | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False, **extra: Any) -> list[int]:
    """Template-rendered prompt ids. The template writes the special tokens (BOS included) itself,
    so the text is encoded without adding them again, as transformers does. continue_final_message:
    the final (assistant) message is left open, the prompt ending with its text, so the model goes on
    writing it (an assistant prefill: transformers' and vLLM's flag, what Ollama's /api/chat does
    with a final assistant message)."""
    if continue_final_message:
        final = messages[-1] if messages else {}
        if final.get("role") != "assistant" or not (final.get("content") or "").strip():
            raise bad_request("continue_final_message needs the last message to be the assistant's, with text",
                              "messages")
        add_generation_prompt = False
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **({"tools": tools} if tools else {}), **extra)
    except ChatTemplateError as exc:
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None
    except TokenizerError as exc:
        raise bad_request(str(exc), "messages") from None
    if continue_final_message:
        text = _cut_after_final(text, messages[-1]["content"])
    return tokenizer.encode(text, add_special_tokens=False)


def _cut_after_final(text: str, final: str) -> str:
    """The rendered chat up to the end of the final message's text: what the template writes after it
    (the end of the turn) is dropped. Templates may strip a message's text, so its stripped form is what
    is looked for, and the last occurrence (as transformers does)."""
    final = final.strip()
    at = text.rfind(final)
    if at < 0:
        raise bad_request("the chat template does not write the last message's text as it is, so it cannot be "
                          "continued", "messages")
    return text[:at + len(final)]


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens=True)


def render_prompt(tokenizer: Tokenizer, prompt: str, *, system: str | None = None, raw: bool = False,
                  **variables: Any) -> list[int]:
    """Ollama's /api/generate prompt: templated as one user turn unless raw (`variables` reach the
    template: enable_thinking); a model without a template gets the text as is (Ollama's default
    template is just the prompt)."""
    if raw:
        return encode_prompt(tokenizer, prompt)
    if tokenizer.chat_template is None:
        return encode_prompt(tokenizer, f"{system}\n\n{prompt}" if system else prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return render_chat(tokenizer, messages, **variables)


def check_token_ids(ids: Any, vocab_size: int, field: str) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request(f"{field} must be a list of token ids", field)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"{field}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})", field)
    return ids


async def off_loop(work: Callable[[], T], chars: int) -> T:
    """Run `work` (a request's template rendering and tokenizing) on a worker thread when its input
    is long: a 1 MB prompt takes about a second to tokenize, during which the event loop would
    answer nothing, /health included. The tokenizer releases the GIL on long texts, so the loop
    really runs meanwhile. `chars` is the input's size in characters."""
    if chars <= INLINE_CHARS:
        return work()
    return await run_in_threadpool(work)


def chars_in(value: Any) -> int:
    """Characters in the strings of a request input (a prompt, a list of them, messages)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(chars_in(v) for v in value.values())
    if isinstance(value, list):
        return sum(chars_in(v) for v in value)
    return 0
