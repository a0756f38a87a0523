"""The two ways `tokenmill run` gets an answer: from a running server (`RemoteChat`, Ollama's API,
as `ollama run` does) or from an engine in this process (`LocalChat`). Each answers a `Turn` (the
message and what the session set) as a stream of text and keeps the answer's figures (`Stats`). A
thinking model's reasoning comes in the same stream, as `Thought` pieces before the answer's."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from tokenmill.engine import EngineConfig, LLMEngine, OutputAssembler, SamplingParams
from tokenmill.server_client import call, server_url, stream
from tokenmill.store.modelfile import IGNORED_PARAMETER_TYPES

class Thought(str):
    """A piece of a thinking model's reasoning (what Ollama's API sends as `thinking`)."""


# Ollama option names a session may set (/set parameter), as the in-process chat's SamplingParams fields.
_LOCAL_OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                  "min_p": "min_p", "typical_p": "typical_p", "seed": "seed", "stop": "stop",
                  "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
                  "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


@dataclass
class Turn:
    """One message to answer, with what the session has set: the conversation so far, a system
    message, options (Ollama's names) and an output format."""
    prompt: str
    history: list[dict] = field(default_factory=list)
    system: str | None = None
    options: dict = field(default_factory=dict)
    format: str | None = None  # "json"
    raw: bool = False          # the prompt as is, no template and no history
    think: bool | str | None = None  # Ollama's `think`: None for the model's default

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, *self.history, {"role": "user", "content": self.prompt}]


@dataclass
class Stats:
    """Ollama's figures for one answer (`run --verbose`, /set verbose)."""
    total_s: float
    load_s: float
    prompt_count: int
    prompt_s: float
    eval_count: int
    eval_s: float

    @classmethod
    def from_ollama(cls, done: dict) -> "Stats":
        def s(key: str) -> float:
            return (done.get(key) or 0) / 1e9

        return cls(s("total_duration"), s("load_duration"), int(done.get("prompt_eval_count") or 0),
                   s("prompt_eval_duration"), int(done.get("eval_count") or 0), s("eval_duration"))

    def lines(self) -> list[str]:
        def rate(count: int, seconds: float) -> str:
            return f"{count / seconds:.2f} tokens/s" if seconds > 0 else "-"

        return [f"total duration:       {_duration(self.total_s)}",
                f"load duration:        {_duration(self.load_s)}",
                f"prompt eval count:    {self.prompt_count} token(s)",
                f"prompt eval duration: {_duration(self.prompt_s)}",
                f"prompt eval rate:     {rate(self.prompt_count, self.prompt_s)}",
                f"eval count:           {self.eval_count} token(s)",
                f"eval duration:        {_duration(self.eval_s)}",
                f"eval rate:            {rate(self.eval_count, self.eval_s)}"]


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}s" if seconds >= 1 else f"{seconds * 1e3:.3f}ms"


class LocalChat:
    """The engine in this process. A created model (`create`, `cp`) runs with its weights (a blob, or
    its base's file) and its profile as a server applies it: PARAMETERs under the options given
    (`options`: the run's own flags, Ollama's names), SYSTEM and MESSAGEs opening the conversation,
    TEMPLATE rendering it."""

    def __init__(self, model: str, dtype: str, progress: bool = True, options: dict | None = None):
        from tokenmill.server.profiles import tokenizer_for
        from tokenmill.store.names import resolve_local

        self.model = model
        resolved = resolve_local(model, progress=progress)
        self.profile = resolved.profile
        self.engine = LLMEngine.from_path(resolved.path, EngineConfig(dtype=dtype), progress=progress)
        self.tokenizer = tokenizer_for(self.engine.tokenizer, self.profile)
        # The profile's PARAMETERs this path takes, under the run's own flags.
        defaults = {k: v for k, v in self.profile.parameters.items() if k in _LOCAL_OPTIONS}
        self.options = {**defaults, **(options or {})}
        self.stats: Stats | None = None

    @staticmethod
    def takes_option(name: str) -> bool:
        return name in _LOCAL_OPTIONS or name in IGNORED_PARAMETER_TYPES  # checked, then ignored, as a server does

    def params_for(self, turn: Turn, params: SamplingParams) -> SamplingParams:
        """The run's parameters with the session's options over them (their ranges checked)."""
        unknown = sorted(set(turn.options) - set(_LOCAL_OPTIONS))
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: only a server uses {'it' if len(unknown) == 1 else 'them'}")
        options = {**self.options, **turn.options}
        params = replace(params, **{_LOCAL_OPTIONS[k]: v for k, v in options.items()})
        if "num_predict" in options and options["num_predict"] < 0:
            params.max_tokens = None  # Ollama's -1 and -2: until the model stops or the context is full
        if turn.format == "json":
            from tokenmill.structured.compiler import compiler_for
            from tokenmill.structured.grammar import GrammarSpec

            params.constraint = compiler_for(self.tokenizer).compile_now(GrammarSpec("json"))
        params.validate()
        return params

    def stream(self, turn: Turn, params: SamplingParams) -> Iterator[str]:
        from tokenmill.server.profiles import chat_messages
        from tokenmill.server.thinking import after_thinking, grammar_can_wait, model_thinks, reading_for
        from tokenmill.structured.compiler import compiler_for
        from tokenmill.structured.grammar import GrammarSpec

        params = self.params_for(turn, params)
        thinks = model_thinks(self.tokenizer) and not turn.raw
        if turn.think not in (None, False) and not thinks:
            raise ValueError(f'"{self.model}" does not support thinking')
        reading = None
        if turn.raw:
            ids = self.tokenizer.encode(turn.prompt)
        else:
            variables = {"enable_thinking": False} if thinks and turn.think is False else {}
            messages = chat_messages(turn.messages(), self.profile)
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                           **variables), add_special_tokens=False)
            # JSON waits for the reasoning, as a server's format does (server/thinking.py)
            waits = (turn.format == "json" and turn.think is not False
                     and grammar_can_wait(self.tokenizer, GrammarSpec("json")))
            if waits:
                params.constraint = compiler_for(self.tokenizer).compile_now(
                    after_thinking(self.tokenizer, GrammarSpec("json"), ids))
            reading = reading_for(self.tokenizer, ids, wanted=turn.think is not False,
                                  constrained=params.constraint is not None and not waits)
        split = reading.split() if reading is not None else None
        self.stats = None
        start = time.perf_counter()
        first: float | None = None
        count = 0
        rid = self.engine.add_request(ids, params)
        asm = OutputAssembler(self.tokenizer, params)
        try:
            while self.engine.has_unfinished():
                for ev in self.engine.step():
                    first = first if first is not None or not ev.token_ids else time.perf_counter()
                    count += len(ev.token_ids)
                    delta = asm.push(ev)
                    if split is not None:
                        thought, text = split.take(delta.text, delta.finished)
                        if thought:
                            yield Thought(thought)
                    else:
                        text = delta.text
                    if text:
                        yield text
                    if delta.hit_stop_string:
                        self.engine.abort(rid)
                    if delta.error:
                        raise RuntimeError(delta.error)
            if split is not None:  # a stop string ended it: what the split still holds
                thought, text = split.finish()
                yield from ([Thought(thought)] if thought else []) + ([text] if text else [])
        finally:
            self.engine.abort(rid)  # Ctrl-C mid-answer: free the sequence
        end = time.perf_counter()
        first = first if first is not None else end
        self.stats = Stats(end - start, 0.0, len(ids), first - start, count, end - first)


class RemoteChat:
    """Streams /api/chat (or, raw, /api/generate) from a running tokenmill or Ollama server. Only the
    options the user gave are sent (`options`), as Ollama's run does: a model created with PARAMETER
    num_predict or temperature keeps them unless a flag overrides them."""

    def __init__(self, base_url: str, model: str, options: dict | None = None, keep_alive: str | None = None):
        self.base_url = server_url(base_url)
        self.model = model
        self.options = options or {}
        self.keep_alive = keep_alive  # Ollama's duration text; None: the server's default
        self.stats: Stats | None = None

    def _body(self, **fields) -> dict:
        body = {"model": self.model, **fields}
        if self.keep_alive is not None:
            body["keep_alive"] = self.keep_alive
        return body

    @staticmethod
    def takes_option(name: str) -> bool:
        return True  # the server checks them

    def load(self) -> None:
        """Ollama's load request (a model and no prompt): an unknown model, or one that cannot load,
        is an error before the interactive prompt opens rather than after the first message."""
        call(self.base_url, "POST", "/api/generate", self._body(stream=False))

    def stream(self, turn: Turn, params: SamplingParams) -> Iterator[str]:
        body = self._body(stream=True, options={**self.options, **turn.options})
        if turn.format is not None:
            body["format"] = turn.format
        if turn.think is not None:
            body["think"] = turn.think
        if turn.raw:
            body.update(prompt=turn.prompt, raw=True)
        else:
            body["messages"] = turn.messages()
        self.stats = None
        path, key = ("/api/generate", "response") if turn.raw else ("/api/chat", None)
        for obj in stream(self.base_url, path, body):
            part = obj if key else obj.get("message", {})
            if part.get("thinking"):
                yield Thought(part["thinking"])
            yield part.get(key or "content", "")
            if obj.get("done"):
                self.stats = Stats.from_ollama(obj)
