"""A derived model's defaults applied to a request that names it (Ollama's Modelfile semantics): its
PARAMETERs are defaults the request's own options override, its SYSTEM prompt is used when the request
has none, its MESSAGEs open the conversation, and its TEMPLATE renders the chat.

TEMPLATE takes a Jinja chat template, as GGUF files carry, or Ollama's classic Go-template form
built from `.System`, `.Prompt` and `.Response` with `if`/`else`/`end`, which is rendered once per
user turn (the last turn stops where `.Response` would be). Go templates that range over `.Messages`
or call functions are not translated: use Jinja for those."""
from __future__ import annotations

import re
from tokenmill.server.errors import APIError, bad_request
from tokenmill.store.derived import Profile
from tokenmill.tokenizer import ChatTemplateError, Tokenizer

# Ollama PARAMETER names -> OpenAI / vLLM body fields, for OpenAI requests to a derived model.
_OPENAI_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "num_predict": "max_tokens", "stop": "stop", "seed": "seed",
                  "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty"}
_GO_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_GO_FIELDS = {".System": "system", ".Prompt": "prompt", ".Response": "response"}


def ollama_body(body: dict, profile: Profile) -> dict:
    """The request with the profile's parameters under its own options."""
    if not profile.parameters:
        return body
    options = body.get("options") if isinstance(body.get("options"), dict) else {}
    return {**body, "options": {**profile.parameters, **options}}


def openai_body(body: dict, profile: Profile) -> dict:
    params = profile.parameters
    defaults = {field: params[name] for name, field in _OPENAI_FIELDS.items()
                if name in params and body.get(field) is None and not _ollama_off(name, params[name])}
    return {**defaults, **body} if defaults else body


def _ollama_off(name: str, value) -> bool:
    """Ollama's values for "no limit" / "random", which OpenAI's fields spell by leaving them out."""
    return (name == "num_predict" and value <= 0) or (name == "seed" and value < 0)


def system_prompt(requested: str | None, profile: Profile) -> str | None:
    return requested if requested else profile.system


def chat_messages(messages: list[dict], profile: Profile) -> list[dict]:
    """The profile's MESSAGEs first, and its SYSTEM unless the conversation brings its own."""
    out = [*profile.messages, *messages]
    if profile.system and not any(m.get("role") == "system" for m in out):
        out.insert(0, {"role": "system", "content": profile.system})
    return out


def tokenizer_for(tokenizer: Tokenizer, profile: Profile) -> Tokenizer:
    if not profile.template:
        return tokenizer
    try:
        return tokenizer.with_chat_template(jinja_template(profile.template, bos=tokenizer.add_bos))
    except ChatTemplateError as exc:
        raise bad_request(f"the model's TEMPLATE does not compile: {exc}", "model") from None


def with_request_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    """/api/generate's `template`: this request's prompt rendered with it (either form TEMPLATE takes)
    instead of the model's own."""
    try:
        return tokenizer.with_chat_template(jinja_template(template, bos=tokenizer.add_bos))
    except ChatTemplateError as exc:
        raise bad_request(f"template does not compile: {exc}", "template") from None
    except APIError as exc:  # a Go action jinja_template cannot translate: named as the request names it
        raise bad_request(exc.message.replace("TEMPLATE:", "template:", 1), "template") from None


def jinja_template(template: str, *, bos: bool = False) -> str:
    """A Jinja chat template for TEMPLATE. A Go template starts with the BOS token when the model's
    tokenizer adds one (Ollama's templates leave it to the tokenizer; chat templates write it)."""
    if "{%" in template or "messages" in template:
        return template  # already a Jinja chat template
    head, marker, tail = template.partition("{{ .Response }}")
    if not marker:
        head, tail = template, ""
    turn = _go_to_jinja(head)
    done = turn + "{{ response }}" + _go_to_jinja(tail)
    # No whitespace control in the scaffolding: it must not eat the template's own newlines.
    return (
        ("{{ bos_token }}" if bos else "") +
        "{% set ns = namespace(system='') %}"
        "{% for m in messages %}"
        "{% if m.role == 'system' %}{% set ns.system = m.content %}"
        "{% elif m.role == 'user' %}"
        "{% set system = ns.system %}{% set prompt = m.content %}{% set ns.system = '' %}"
        "{% set nxt = messages[loop.index0 + 1] if loop.index0 + 1 < messages | length else none %}"
        "{% if nxt is not none and nxt.role == 'assistant' %}{% set response = nxt.content %}" + done +
        "{% else %}" + turn + "{% endif %}"
        "{% endif %}"
        "{% endfor %}"
    )


def _go_to_jinja(text: str) -> str:
    def action(m: re.Match) -> str:
        left, expr, right = m.group(1), m.group(2), m.group(3)
        words = expr.split()
        if expr in _GO_FIELDS:
            return "{{" + left + " " + _GO_FIELDS[expr] + " " + right + "}}"
        # Go keeps the newline after {{ end }}; "+" keeps Jinja's trim_blocks from eating it.
        close = right + "%}" if right else "+%}"
        if len(words) == 2 and words[0] == "if" and words[1] in _GO_FIELDS:
            return "{%" + left + " if " + _GO_FIELDS[words[1]] + " " + close
        if expr == "else":
            return "{%" + left + " else " + close
        if expr == "end":
            return "{%" + left + " endif " + close
        raise bad_request(f"TEMPLATE: {{{{ {expr} }}}} is not supported; use .System, .Prompt, .Response "
                          "with if/else/end, or a Jinja chat template", "template")

    return _GO_ACTION.sub(action, text)
