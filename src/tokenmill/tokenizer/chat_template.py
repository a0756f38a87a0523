"""Render a model's Jinja chat template exactly as transformers' `apply_chat_template` does.

Chat templates ship inside model files, so they are untrusted code: they run in Jinja's immutable
sandbox, and everything they can see is rebuilt from plain JSON-like values first. The environment,
globals and filters mirror transformers' `utils/chat_template_utils.py` so the rendered prompt is
byte-identical to the one the model was fine-tuned on.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

from tokenmill.tokenizer.template_budget import TemplateBudgetError, render_budget, size_of
from tokenmill.tokenizer.template_sandbox import BudgetedSandbox


# Both errors live here rather than in tokenizer.py so that this module imports nothing from the
# package (tokenizer.py imports it); `tokenmill.tokenizer` re-exports them.
class TokenizerError(Exception):
    """The model's tokenizer cannot be built or used; the message says why."""


class ChatTemplateError(TokenizerError):
    """The chat template does not compile, rejected its input, or broke a sandbox rule."""


class _RaisedByTemplate(TemplateError):
    """Marks an error the template raised on purpose, so its message is passed on unchanged."""


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>' and '&', which would corrupt tool schemas in prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# strftime writes up to ~30 characters for a two-character directive (%c): a format this long is
# already more than any template's date line, and a longer one would be an amplifier.
MAX_STRFTIME_FORMAT = 256


def _strftime_now(format: str) -> str:
    if len(format) > MAX_STRFTIME_FORMAT:
        raise ValueError(f"strftime_now's format is {len(format)} characters; the limit is {MAX_STRFTIME_FORMAT}")
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` for templates, without exposing the `dict` type itself to attribute tricks."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, which could shadow CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Same signature trick as Jinja's Namespace, so that `namespace(self=...)` still works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}`, which transformers uses to mark assistant
    tokens for training masks; for inference the block renders as plain text."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


# Keys older clients use for a message's reasoning; the first is the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning_fields(message: dict) -> dict:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """Rebuild `value` from plain JSON-like types. Rich objects carry methods the sandbox does not know
    are dangerous, so anything else becomes an inert placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models, e.g. API request bodies
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _environment() -> BudgetedSandbox:
    # The sandbox is Jinja's immutable one, with every render held to a budget (template_budget.py):
    # a template that loops or recurses without end, or builds a gigabyte, fails as the template's error.
    env = BudgetedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.meter_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


# Real chat templates are up to ~20 KB (tool-calling ones). Compiling costs far more than the text:
# 128 KiB of `{{x}}` takes ~2 s and ~270 MB here (4 MB took 60 s and 4.6 GB), and a model file or an
# /api/create TEMPLATE may carry megabytes.
MAX_TEMPLATE_CHARS = 128 * 1024


class ChatTemplate:
    """A compiled chat template. `None` for a special token means the model has none, and the
    template then sees the name as undefined, as under transformers."""

    def __init__(self, source: str, *, bos_token: str | None = "", eos_token: str | None = "",
                 unk_token: str | None = None, pad_token: str | None = None):
        self.source = source
        named = {"bos_token": bos_token, "eos_token": eos_token, "unk_token": unk_token, "pad_token": pad_token}
        self._special_tokens = {name: token for name, token in named.items() if token is not None}
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"chat template is {len(source)} characters; the limit is {MAX_TEMPLATE_CHARS}")
        try:
            self._template = _environment().from_string(source)
        except TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from exc
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        except RecursionError:
            raise ChatTemplateError("chat template does not compile: it is nested too deeply") from None

    @property
    def special_tokens(self) -> dict[str, str]:
        return dict(self._special_tokens)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **extra: Any) -> str:
        """The prompt for `messages`. `extra` reaches the template as variables (e.g. `documents`,
        `enable_thinking`) and overrides the special-token names, as in transformers."""
        # Clients send `content: null` or `tool_calls: null`; templates handle a missing key but
        # often print "None" for a null one, so transformers drops them and so do we.
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"chat messages must be dicts, got {type(message).__name__}")
            chat.append(_alias_reasoning_fields(_plain({k: v for k, v in message.items() if v is not None})))
        documents = extra.pop("documents", None)
        variables = _plain({**self._special_tokens, **extra})
        tools, documents = _plain(tools), _plain(documents)
        try:
            with render_budget(size_of((chat, tools, documents, variables))):
                return self._template.render(messages=chat, tools=tools, documents=documents,
                                             add_generation_prompt=add_generation_prompt, **variables)
        except _RaisedByTemplate as exc:
            raise ChatTemplateError(exc.message or "") from exc
        except TemplateBudgetError as exc:
            raise ChatTemplateError(str(exc)) from exc
        except SecurityError as exc:
            raise ChatTemplateError(f"chat template broke a sandbox rule: {exc}") from exc
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a template is code; any crash in it is the template's error
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
