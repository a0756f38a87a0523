"""A thinking model's reasoning, told apart from its answer. Qwen3, QwQ and DeepSeek-R1's distills
write their reasoning between `<think>` and `</think>` before the answer; the APIs hand it back apart:
Ollama's `thinking` field, OpenAI-style `reasoning_content` (vLLM's reasoning parsers, DeepSeek's API),
Anthropic's thinking blocks.

A model thinks when its chat template writes think tags. Some templates open the block in the prompt
(DeepSeek-R1's and Qwen3's thinking-only models end the generation prompt with `<think>\\n`), so the
answer then starts inside it: `Thinking.for_prompt` tells from the prompt's last tokens.

The split works on a stream: text that may be the start of a tag is held back until the next piece
says what it is, so no tag is ever sent in part. Whitespace around the reasoning and between it and
the answer is dropped, as Qwen3's template does when it writes a past turn back."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.structured import GrammarSpec
from tokenmill.structured.grammar import ThinkingFirst
from tokenmill.tokenizer import Tokenizer

OPEN = "<think>"
CLOSE = "</think>"
_TAIL_TOKENS = 8  # enough of the prompt's end to hold `<think>` and the whitespace after it


def template_thinks(source: str) -> bool:
    """Whether a chat template writes think tags: the capability Ollama's /api/show lists as
    "thinking" and the `think` field needs."""
    return OPEN in source and CLOSE in source


def model_thinks(tokenizer: Tokenizer) -> bool:
    template = tokenizer.chat_template
    return template is not None and template_thinks(template.source)


@dataclass(frozen=True)
class Thinking:
    """How to read one request's answer: `starts_inside` when its prompt left a think block open."""
    starts_inside: bool = False

    @classmethod
    def for_prompt(cls, tokenizer: Tokenizer, prompt_ids: list[int]) -> "Thinking":
        tail = tokenizer.decode(prompt_ids[-_TAIL_TOKENS:]).rstrip()
        return cls(starts_inside=tail.endswith(OPEN))

    def split(self) -> "ThinkingSplit":
        return ThinkingSplit(self.starts_inside)

    def split_text(self, text: str) -> tuple[str, str]:
        """A whole answer's (reasoning, answer)."""
        split = self.split()
        a = split.feed(text)
        b = split.finish()
        return a[0] + b[0], a[1] + b[1]


class ThinkingSplit:
    """Pieces of generated text in, (reasoning, answer) pieces out. States: before anything but
    whitespace was seen (an opening tag may come), inside the block, and after it (all answer)."""

    def __init__(self, starts_inside: bool = False):
        self.state = "thinking" if starts_inside else "start"
        self.held = ""  # text not yet sent: a possible tag's start, or (inside) trailing whitespace
        self.thought = False  # some reasoning went out (its leading whitespace is dropped until then)
        self.answered = False  # some answer went out (the whitespace after the block is dropped until then)

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = answer = ""
        while True:
            if self.state == "start":
                rest = self.held.lstrip()
                if rest.startswith(OPEN):
                    self.state, self.held = "thinking", rest[len(OPEN):]
                    continue
                if not rest or OPEN.startswith(rest):
                    break  # only whitespace, or the tag's beginning: wait for more
                self.state = "answer"  # no block: the whole text is the answer, as written
                self.answered = True
                continue
            if self.state == "thinking":
                at = self.held.find(CLOSE)
                if at >= 0:
                    reasoning += self._reasoning(self.held[:at].rstrip())
                    self.state, self.held = "answer", self.held[at + len(CLOSE):]
                    continue
                keep = _partial_tag_length(self.held, CLOSE)
                body = self.held[:len(self.held) - keep]
                sendable = body.rstrip()  # whitespace may be the block's last: held until text follows it
                reasoning += self._reasoning(sendable)
                self.held = self.held[len(sendable):]
                break
            if not self.answered:
                self.held = self.held.lstrip()
                if not self.held:
                    break
                self.answered = True
            answer += self.held
            self.held = ""
            break
        return reasoning, answer

    def take(self, text: str, finished: bool) -> tuple[str, str]:
        """A stream's piece as (reasoning, answer); the last one (`finished`) with all that was held."""
        reasoning, answer = self.feed(text)
        if finished:
            more = self.finish()
            reasoning, answer = reasoning + more[0], answer + more[1]
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is still held when the generation ends: an unfinished block's text is reasoning (the
        model ran out of tokens while thinking); a lone tag's start is answer text."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return self._reasoning(held.rstrip()), ""
        if self.state == "start":
            return "", held if held.strip() else ""
        return "", held if self.answered else held.lstrip()

    def _reasoning(self, text: str) -> str:
        if not self.thought:
            text = text.lstrip()
            self.thought = bool(text)
        return text


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def reading_for(tokenizer: Tokenizer, prompt_ids: list[int], *, wanted: bool, constrained: bool) -> Thinking | None:
    """How to read a request's answer, None for as written: split when the model thinks and the request
    did not turn thinking off (`wanted`), or when its prompt left a block open anyway (a template that
    always thinks). A grammar that holds from the first token (`constrained`: one that does not wait for
    the reasoning, see grammar_can_wait): inside a block the prompt opened, what it makes is the answer,
    so that is not split; else the text is split only if the grammar itself writes a block (a regex that
    does), as any text that does not open with the tag is all answer."""
    if not model_thinks(tokenizer):
        return None
    reading = Thinking.for_prompt(tokenizer, prompt_ids)
    if reading.starts_inside:
        return None if constrained else reading
    return reading if wanted else None


def grammar_can_wait(tokenizer: Tokenizer, spec: GrammarSpec | None) -> bool:
    """Whether a request's grammar can wait for the model's reasoning (ThinkingFirst) rather than hold
    from the first token: a JSON format (Ollama's `format`, OpenAI's `response_format`, a forced tool
    call), asked of a model that thinks, whose tags are text (a special token is outside every grammar's
    text, so the block could not close). A client's regex, choice or grammar is the whole output (it may
    write the block itself) and holds from the first token."""
    return (spec is not None and spec.kind in ("json", "json_schema") and model_thinks(tokenizer)
            and not any(tokenizer.is_special(i) for i in tokenizer.encode(OPEN + CLOSE, add_special_tokens=False)))


def reading_and_grammar(tokenizer: Tokenizer, prompt_ids: list[int], found: tuple[GrammarSpec, str] | None, *,
                        wanted: bool, can_wait: bool) -> tuple[Thinking | None, tuple[GrammarSpec, str] | None]:
    """A rendered request's reading (reading_for) and its grammar (`found`: spec and field), which waits for
    the reasoning where it can (`can_wait`: grammar_can_wait, asked before rendering, as it decides the
    template's thinking switch) and the request wants the model to think."""
    waits = found is not None and can_wait and wanted
    reading = reading_for(tokenizer, prompt_ids, wanted=wanted, constrained=found is not None and not waits)
    if waits:
        found = after_thinking(tokenizer, found[0], prompt_ids), found[1]
    return reading, found


def after_thinking(tokenizer: Tokenizer, spec: GrammarSpec, prompt_ids: list[int]) -> GrammarSpec:
    """spec waiting for the think block: the one the prompt opened, or one the model may open."""
    inside = Thinking.for_prompt(tokenizer, prompt_ids).starts_inside
    return spec.after_thinking(ThinkingFirst(OPEN, CLOSE, inside))
