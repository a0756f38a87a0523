"""A chat stream with tools, as Ollama (0.8+) streams it: the text that is not a call goes out as
content as it is generated, and each call goes out in a message of its own as soon as its arguments
are complete (as an object, Ollama's form), in a `done: false` chunk; the final chunk carries none.

The calls are found by the same parser the OpenAI stream uses (tool_stream.ToolCallStream), which
sends a call's arguments as the JSON text the model writes: they are complete when that text
parses as an object. A call the generation cut short (max tokens) has no complete arguments: it is
sent as the text it was, `{"name": ..., "arguments": ...` as far as it got, so nothing is lost (the
done_reason says `length`), as a non-streaming answer returns such text as content."""
from __future__ import annotations

import json

from tokenmill.server.tools import ToolUse


class OllamaCallStream:
    def __init__(self, tool_use: ToolUse):
        self.parser = tool_use.stream()
        self.name: str | None = None  # the call being written, and its arguments so far
        self.arguments = ""

    def feed(self, text: str, finished: bool) -> list[dict]:
        """The messages ({"content": ...} or {"content": "", "tool_calls": [call]}) this text makes
        sendable, in order; with `finished`, everything that is left."""
        out: list[dict] = []
        pieces = self.parser.feed(text) + (self.parser.finish() if finished else [])
        for p in pieces:
            if p.content is not None:
                out += self._cut() + [{"content": p.content}]
            elif p.name is not None:
                out += self._cut()
                self.name, self.arguments = p.name, ""
                out += self._arguments(p.arguments or "")
            else:
                out += self._arguments(p.arguments or "")
        return out + (self._cut() if finished else [])

    def _arguments(self, piece: str) -> list[dict]:
        if self.name is None:
            return []
        self.arguments += piece
        if not self.arguments.rstrip().endswith("}"):
            return []  # an object ends with its brace: no parse of every piece of long arguments
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return []  # not complete yet
        if not isinstance(value, dict):
            return []
        call = {"function": {"name": self.name, "arguments": value}}
        self.name, self.arguments = None, ""
        return [{"content": "", "tool_calls": [call]}]

    def _cut(self) -> list[dict]:
        """A call left incomplete, as the text the model wrote of it."""
        if self.name is None:
            return []
        text = f'{{"name": {json.dumps(self.name)}, "arguments": {self.arguments}'
        self.name, self.arguments = None, ""
        return [{"content": text}]
