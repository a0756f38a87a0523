"""Tool calls found in a model's text while it is being generated, so a stream can send them as
deltas: the text before a call goes out as content at once, a call goes out as soon as its function
name is known (id, name), then its arguments in pieces as the model writes them.

It reads the formats `ToolUse.extract` reads: `<tool_call>{...}</tool_call>` blocks anywhere in the
text, or the whole text as one bare JSON call or a list of calls (possibly in a ```json fence), a
call being `{"name": ..., "arguments": {...}}` ("parameters" is accepted for "arguments", and
arguments written as a JSON string are unwrapped). Text that turns out not to be a call (an unknown
function, a JSON object without a name) is released as content: nothing is lost. Once a call's
header is out the call is committed: if the model stops mid-arguments (max tokens), the arguments
stay incomplete, as the finish reason says.

One pass over each character, so a long answer costs linear time, not a re-parse per token."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")
_FENCE_HEAD = re.compile(r"```(?:json)?\s*")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Piece:
    """One thing to send: content text, or part of call `index` (its header when `name` is set,
    else a piece of its arguments)."""
    content: str | None = None
    index: int = 0
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


class CallScanner:
    """Follows one JSON call object character by character: the value of its "name" member, and
    the raw text of its arguments (which is exactly what a client concatenates)."""

    def __init__(self) -> None:
        self.phase = "open"  # open, key, key_string, colon, value_start, value, after_value, done
        self.key = ""  # the current member's key as written (JSON string syntax)
        self.member: str | None = None  # ... and as a string, once complete
        self.value: list[str] = []  # the current member's value as written, a character each
        self.depth = 0  # nesting inside the current member value
        self.in_string = False
        self.escaped = False
        self.name: str | None = None
        self.bad = False  # this object cannot be a call
        self.arguments_kind: str | None = None  # "object" (streamed raw) or "string" (unwrapped at its end)
        self.arguments = ""  # arguments seen and not yet taken
        self.saw_arguments = False

    @property
    def done(self) -> bool:
        return self.phase == "done"

    def take_arguments(self) -> str:
        out, self.arguments = self.arguments, ""
        return out

    def push(self, c: str) -> None:
        if self.bad or self.done:
            return
        phase = self.phase
        if phase == "open":
            if c == "{":
                self.phase = "key"
            elif not c.isspace():
                self.bad = True
        elif phase == "key":
            if c == '"':
                self.phase, self.key, self.escaped = "key_string", c, False
            elif c == "}":
                self._end()
            elif not (c.isspace() or c == ","):
                self.bad = True
        elif phase == "key_string":
            self.key += c
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.phase = "colon"
                try:
                    self.member = json.loads(self.key)
                except json.JSONDecodeError:
                    self.bad = True
        elif phase == "colon":
            if c == ":":
                self.phase = "value_start"
            elif not c.isspace():
                self.bad = True
        elif phase == "value_start":
            if not c.isspace():
                self.phase, self.value, self.depth, self.in_string, self.escaped = "value", [], 0, False, False
                self._value_char(c)
        elif phase == "value":
            self._value_char(c)
        elif phase == "after_value":
            self._after_value(c)

    def _after_value(self, c: str) -> None:
        if c == ",":
            self.phase = "key"
        elif c == "}":
            self._end()
        elif not c.isspace():
            self.bad = True

    def _value_char(self, c: str) -> None:
        scalar = (self.value[0] if self.value else c) not in "{[\""
        if scalar and self.value and (c in ",}" or c.isspace()):
            self._value_end()
            self._after_value(c)
            return
        self.value.append(c)
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
        if self.member in _ARGUMENT_KEYS:
            if self.arguments_kind is None:
                self.arguments_kind = "object" if c == "{" else "string" if c == '"' else "other"
            if self.arguments_kind == "object":
                self.arguments += c
        complete = not scalar and self.depth == 0 and not self.in_string and (len(self.value) > 1 or c != '"')
        if complete:
            self._value_end()

    def _value_end(self) -> None:
        self.phase = "after_value"
        key = self.member
        try:
            value = json.loads("".join(self.value))
        except (ValueError, RecursionError):  # not JSON, or a number or nesting Python will not hold
            value = None
        if key == "name":
            if isinstance(value, str):
                self.name = value
            else:
                self.bad = True
        elif key in _ARGUMENT_KEYS:
            self.saw_arguments = True
            if self.arguments_kind == "string" and isinstance(value, str):
                self.arguments = value
            elif self.arguments_kind != "object":
                self.bad = True

    def _end(self) -> None:
        self.phase = "done"
        if self.name is None:
            self.bad = True


class ToolCallStream:
    """Feed it the text as it arrives; it returns what can be sent now. `finish()` flushes the rest."""

    def __init__(self, names: set[str], max_calls: int | None = None):
        self.names = names
        self.max_calls = max_calls
        self.num_calls = 0
        self.mode = "start"  # start, fence, text, region, tail
        self.held = ""  # text not sent yet: the start, a partial tag, or a region that may not be a call
        self.in_block = False  # the region is a <tool_call> block (else the whole text)
        self.in_list = False  # the region is a [...] of calls
        self.scanner: CallScanner | None = None
        self.announced = False  # the current scanner's call header is out
        self.muted = False  # the current call is dropped (over max_calls, or bad after the region committed)
        self.region_committed = False
        self.tail_seen = ""  # a partial closing tag or fence after a region
        self.out: list[Piece] = []

    # --- public -----------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Piece]:
        for c in text:
            self._push(c)
        return self._flush()

    def finish(self) -> list[Piece]:
        if self.mode in ("start", "fence", "text") or (self.mode == "region" and not self.region_committed):
            self._content(self.held)
        self.held = ""
        return self._flush()

    # --- internals --------------------------------------------------------------------------------
    def _flush(self) -> list[Piece]:
        merged: list[Piece] = []
        for p in self.out:
            if merged and p.content is not None and merged[-1].content is not None:
                merged[-1].content += p.content
            elif merged and p.content is None and p.name is None and merged[-1].content is None \
                    and merged[-1].index == p.index:
                merged[-1].arguments += p.arguments
            else:
                merged.append(p)
        self.out = []
        return [p for p in merged if p.content != ""]

    def _content(self, text: str) -> None:
        if text:
            self.out.append(Piece(content=text))

    def _push(self, c: str) -> None:
        if self.mode == "start":
            self._start(c)
        elif self.mode == "fence":
            self._fence(c)
        elif self.mode == "text":
            self._text(c)
        elif self.mode == "region":
            self._region(c)
        else:
            self._tail(c)

    def _start(self, c: str) -> None:
        if c.isspace():
            self.held += c
        elif c in "{[":
            self._open_region(in_block=False)
            self._region(c)
        elif c == "`":
            self.mode = "fence"
            self.held += c
        else:
            self.mode = "text"
            self._content(self.held)
            self.held = ""
            self._text(c)

    def _fence(self, c: str) -> None:
        head = self.held.lstrip()
        if c in "{[" and _FENCE_HEAD.fullmatch(head):
            self._open_region(in_block=False)
            self._region(c)
        elif _FENCE_HEAD.fullmatch(head + c) or "```json".startswith(head + c):
            self.held += c
        else:
            self.mode = "text"
            self._text(c)

    def _text(self, c: str) -> None:
        """Content goes out at once, but for an end that may be the start of a <tool_call> tag."""
        held = self.held + c
        if held == OPEN_TAG:
            self._open_region(in_block=True)
            self.held = OPEN_TAG
            return
        keep = next((k for k in range(min(len(held), len(OPEN_TAG) - 1), 0, -1) if OPEN_TAG.startswith(held[-k:])),
                    0)
        self._content(held[:len(held) - keep])
        self.held = held[len(held) - keep:]

    def _open_region(self, in_block: bool) -> None:
        # In a bare region the held whitespace and fence stay held: released with it if it is no call.
        self.mode = "region"
        self.in_block = in_block
        self.in_list = False
        self.scanner = None
        self.region_committed = False

    def _region(self, c: str) -> None:
        if not self.region_committed:  # kept to be released as content if this is no call after all
            self.held += c
        if self.scanner is None:
            if c.isspace() or (self.in_list and c == ","):
                return
            if c == "[" and not self.in_list:
                self.in_list = True
                return
            if c == "]" and self.in_list:
                self._close_region()
                return
            self.scanner, self.announced = CallScanner(), False
            self.muted = self.max_calls is not None and self.num_calls >= self.max_calls
        s = self.scanner
        s.push(c)
        if s.name is not None and not self.announced and s.name not in self.names:
            s.bad = True
        if s.bad and not self.announced:
            if not self.region_committed:
                self._release()
                return
            self.muted = True  # a broken call after good ones is dropped
        elif s.name is not None and not self.announced:
            self.announced = self.region_committed = True
            if not self.muted:
                self.out.append(Piece(index=self.num_calls, call_id=new_call_id(), name=s.name, arguments=""))
                self.num_calls += 1
        if self.announced and not self.muted and s.arguments:
            self.out.append(Piece(index=self.num_calls - 1, arguments=s.take_arguments()))
        if s.done or s.bad:
            if self.announced and not self.muted and not s.saw_arguments:
                self.out.append(Piece(index=self.num_calls - 1, arguments="{}"))
            self.scanner = None
            if not self.in_list:
                self._close_region()

    def _release(self) -> None:
        """Not a call after all: what was held is content, and the rest is read as text."""
        text, self.held, self.scanner = self.held, "", None
        self.mode = "text"
        self._content(text)

    def _close_region(self) -> None:
        if not self.region_committed:
            self._release()
            return
        self.held = ""
        self.mode = "tail"
        self.tail_seen = ""

    def _tail(self, c: str) -> None:
        """After a region: a block's closing tag, or a bare call's closing fence, is dropped."""
        if c.isspace() and not self.tail_seen:
            return
        seen = self.tail_seen + c
        if self.in_block and CLOSE_TAG.startswith(seen):
            self.tail_seen = "" if seen == CLOSE_TAG else seen
            if seen == CLOSE_TAG:
                self.mode = "text"
            return
        if not self.in_block and c == "`":
            return
        self.tail_seen = ""
        self.mode = "text"
        for ch in seen:
            self._text(ch)
