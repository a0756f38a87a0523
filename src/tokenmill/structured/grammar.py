"""What a request asks its output to match (`GrammarSpec`), turned into a compiled `Grammar`.

A `Grammar` is a template: a matcher at the start state, never advanced. Every sequence gets its
own copy (`Constraint`, a deep copy costs about a microsecond while compiling costs 0.5 ms to tens
of ms), so n samples and repeated requests with the same schema compile once."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

from tokenmill.structured.constraint import Constraint
from tokenmill.structured.schema_finite import unfinishable_refs

Kind = Literal["json", "json_schema", "regex", "choice", "grammar"]

# JSON as Python's json.dumps writes it (", " and ": "), with no other whitespace: models write this
# form naturally, and a small model given free whitespace can pad an object with newlines until it
# runs out of tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# What llguidance may spend: on building a grammar's lexer (~50k fuel/ms) and per token mask
# (~14k fuel/ms), so neither a pathological schema nor a pathological step can stall the engine.
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_grammar_size=500_000, max_lexer_states=250_000, verbose_errors=False)

# A request's grammar source (schema, regex, grammar text) may be at most this long.
MAX_SOURCE_CHARS = 256 * 1024


class GrammarError(ValueError):
    """The schema or grammar cannot be used; the message names the problem, for a 400."""


@dataclass(frozen=True)
class ThinkingFirst:
    """A thinking model's reasoning before the grammar: the think block is free text, the grammar holds
    from its close tag on (vLLM's structured output with a reasoning parser; Ollama's `format` with
    `think`, which it gets by restarting the request when the thinking ends). Built as an llguidance
    grammar of its own with the request's as a named part, so tags of several tokens work as well as
    one-token ones, and a constrained sequence's masks, speculative rows and forks stay as they are.
    The grammar cannot finish inside the block, so no end of sequence is allowed there: a request ends
    with reasoning and no answer only by running out of tokens."""
    open_tag: str   # "<think>"
    close_tag: str  # "</think>"
    inside: bool    # the prompt opened the block, so the output starts in it (else the model may open one)

    def wrap(self, source: str) -> str:
        """`source` (llguidance's text of one grammar, as a JSON schema compiles to) behind the block."""
        top = json.loads(source)
        grammars = top.get("grammars") or []
        if len(grammars) != 1:  # parts of several refer to each other by index, which the wrapper would shift
            raise GrammarError("only a single grammar can wait for the model's thinking")
        # A few whitespace characters between the block and the answer (Qwen3 writes a blank line); free
        # whitespace lets a small model write newlines until it runs out of tokens.
        block = "think_text /[ \\t\\r\\n]{0,4}/"
        start = f"{block} @answer" if self.inside else f"({json.dumps(self.open_tag)} {block})? @answer"
        lark = f"start: {start}\nthink_text[stop={json.dumps(self.close_tag)}]: /(.|\\n)*/\n"
        return json.dumps({**top, "grammars": [{"lark_grammar": lark}, {**grammars[0], "name": "answer"}]})


@dataclass(frozen=True)
class GrammarSpec:
    """kind: "json" (any JSON object), "json_schema" (value: a schema dict), "regex" (value: a
    pattern), "choice" (value: a list of strings), "grammar" (value: Lark or llama.cpp GBNF text).
    thinking: set when the grammar waits for a thinking model's reasoning (the JSON kinds only)."""
    kind: Kind
    value: Any = None
    thinking: ThinkingFirst | None = None

    def after_thinking(self, thinking: ThinkingFirst) -> "GrammarSpec":
        return dataclasses.replace(self, thinking=thinking)

    def source(self) -> str:
        """The llguidance grammar text (raises GrammarError for what cannot even be converted)."""
        inner = self._own_source()
        return inner if self.thinking is None else self.thinking.wrap(inner)

    def _own_source(self) -> str:
        if self.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "json_schema":
            if not isinstance(self.value, (dict, bool)):
                raise GrammarError(f"a JSON schema must be an object, got {type(self.value).__name__}")
            if self.value is False:
                raise GrammarError("the JSON schema false allows no value")
            schema = {} if self.value is True else self.value  # true: any value (llguidance takes objects only)
            _check_size(json.dumps(schema))
            check_finite(schema)
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
            except ValueError as exc:
                raise GrammarError(f"invalid JSON schema: {_schema_message(str(exc))}") from None
        if self.kind == "regex":
            _check_text(self.value, "a regex")
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            if (not isinstance(self.value, list) or not self.value
                    or not all(isinstance(c, str) and c for c in self.value)):
                raise GrammarError("choices must be a non-empty list of non-empty strings")
            _check_size(json.dumps(self.value))
            return llguidance.grammar_from("choice", self.value)
        if self.kind == "grammar":
            _check_text(self.value, "a grammar")
            try:
                return llguidance.grammar_from("grammar", self.value)
            except ValueError as exc:
                raise GrammarError(str(exc)) from None
        raise GrammarError(f"unknown constraint kind {self.kind!r}")

    def describe(self) -> str:
        return {"json": "JSON object", "json_schema": "JSON schema", "regex": "regex", "choice": "choice",
                "grammar": "grammar"}[self.kind]


def check_finite(schema: Any) -> None:
    """GrammarError if the JSON schema allows no value (see schema_finite)."""
    refs = unfinishable_refs(schema)
    if refs:
        raise GrammarError(f"the JSON schema allows no value: it is recursive without a base case (a value "
                           f"of $ref {', '.join(map(json.dumps, refs[:3]))} must always contain another one, "
                           f"so none can ever be complete)")
    if refs is not None:
        raise GrammarError("the JSON schema allows no value: a part every value must have can never be satisfied")


def _check_text(value: Any, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{what} must be a non-empty string")
    _check_size(value)


def _check_size(text: str) -> None:
    if len(text) > MAX_SOURCE_CHARS:
        raise GrammarError(f"the grammar is {len(text)} characters long; at most {MAX_SOURCE_CHARS} are accepted")


class Grammar:
    """A compiled grammar for one tokenizer; `new_constraint()` gives a sequence its own matcher."""

    def __init__(self, spec: GrammarSpec, tokenizer: llguidance.LLTokenizer, vocab_size: int):
        source = spec.source()
        limits = llguidance.LLParserLimits(**LIMITS)
        # Validation and construction drop the GIL; construction is the expensive part (the lexer).
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer, limits=limits)
        if is_error:
            raise GrammarError(f"invalid {spec.describe()}: {_summary(messages)}")
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.describe()}: {_summary([matcher.get_error()])}")
        _check_can_start(matcher, spec)
        self.spec = spec
        self.vocab_size = vocab_size
        self._template = matcher

    def new_constraint(self) -> Constraint:
        return Constraint(self._template.deep_copy(), self.vocab_size)


def _check_can_start(matcher: llguidance.LLMatcher, spec: GrammarSpec) -> None:
    """A grammar whose start has no way to finish (a rule that only refers to itself) compiles, but
    its parser fails on the first mask; that is asked here, on a copy, so it is a 400 and not an
    empty answer."""
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        raise GrammarError(f"the {spec.describe()} allows no output: its parser stops before the first token "
                           f"({_summary([probe.get_error()])}); is a rule recursive without a base case?")


def _schema_message(text: str) -> str:
    """llguidance's word on a schema, less advice about its own options, which a client cannot set."""
    if "oneOf constraints are not supported" in text:
        return ("oneOf is supported only where its branches plainly exclude each other (different types, for "
                "one); use anyOf where a value may match several")
    return text


def _summary(messages: list[str], limit: int = 400) -> str:
    """llguidance's message on one line (it spans several, with a caret under the culprit)."""
    text = " ".join(line.strip() for line in (messages[0] if messages else "").splitlines() if line.strip())
    text = _schema_message(text) or "rejected by the grammar compiler"
    return text if len(text) <= limit else text[:limit] + "..."
