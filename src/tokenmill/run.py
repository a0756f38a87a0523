"""`tokenmill run MODEL [PROMPT]`: a one-shot answer, or an interactive chat that keeps the
conversation. Talks to a running server when one answers (TOKENMILL_HOST, or --server), else runs
the engine in-process."""
from __future__ import annotations

import sys
from collections.abc import Iterator

from tokenmill.engine import EngineConfig, LLMEngine, OutputAssembler, SamplingParams
from tokenmill.server_client import answers, call, server_url, stream


class LocalChat:
    def __init__(self, model: str, dtype: str, progress: bool = True):
        from tokenmill.store import ensure_model

        self.engine = LLMEngine.from_path(ensure_model(model, progress=progress), EngineConfig(dtype=dtype),
                                          progress=progress)
        self.tokenizer = self.engine.tokenizer

    def stream(self, prompt: str, params: SamplingParams, *, raw: bool = False,
               history: list[dict] | None = None) -> Iterator[str]:
        if raw:
            ids = self.tokenizer.encode(prompt)
        else:
            messages = [*(history or []), {"role": "user", "content": prompt}]
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                        add_special_tokens=False)
        rid = self.engine.add_request(ids, params)
        asm = OutputAssembler(self.tokenizer, params)
        try:
            while self.engine.has_unfinished():
                for ev in self.engine.step():
                    delta = asm.push(ev)
                    if delta.text:
                        yield delta.text
                    if delta.hit_stop_string:
                        self.engine.abort(rid)
                    if delta.error:
                        raise RuntimeError(delta.error)
        finally:
            self.engine.abort(rid)  # Ctrl-C mid-answer: free the sequence


class RemoteChat:
    """Streams /api/chat (or, raw, /api/generate) from a running tokenmill or Ollama server. Only the
    options the user gave are sent (`options`), as Ollama's run does: a model created with PARAMETER
    num_predict or temperature keeps them unless a flag overrides them."""

    def __init__(self, base_url: str, model: str, options: dict | None = None):
        self.base_url = server_url(base_url)
        self.model = model
        self.options = options or {}

    def load(self) -> None:
        """Ollama's load request (a model and no prompt): an unknown model, or one that cannot load,
        is an error before the interactive prompt opens rather than after the first message."""
        call(self.base_url, "POST", "/api/generate", {"model": self.model, "stream": False})

    def stream(self, prompt: str, params: SamplingParams, *, raw: bool = False,
               history: list[dict] | None = None) -> Iterator[str]:
        options = self.options
        if raw:
            body = {"model": self.model, "prompt": prompt, "raw": True, "stream": True, "options": options}
            for obj in stream(self.base_url, "/api/generate", body):
                yield obj.get("response", "")
            return
        body = {"model": self.model, "stream": True, "options": options,
                "messages": [*(history or []), {"role": "user", "content": prompt}]}
        for obj in stream(self.base_url, "/api/chat", body):
            yield obj.get("message", {}).get("content", "")


def _print_stream(chunks: Iterator[str]) -> str:
    parts = []
    try:
        for text in chunks:
            parts.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
    except BaseException:
        if parts:  # the error (or Ctrl-C's exit) goes on a line of its own, not glued to the answer
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    sys.stdout.write("\n")
    return "".join(parts)


def piped_prompt(prompt: str | None) -> str | None:
    """As `ollama run`: stdin that is no terminal (a pipe, a file, /dev/null) is read whole and put
    before the prompt argument, and the answer is one-shot (`cat notes.txt | tokenmill run m
    "summarize"`); without this, each piped line became a chat turn with `>>> ` prompts in the output."""
    try:
        if sys.stdin is not None and sys.stdin.isatty():
            return prompt
        piped = sys.stdin.read() if sys.stdin is not None else ""  # None: started with stdin closed
    except (OSError, ValueError):  # a closed or unreadable stdin holds no prompt
        piped = ""
    if not piped:
        return prompt if prompt is not None else ""
    return " ".join(p for p in (piped, prompt) if p)


def interactive(chat, params: SamplingParams) -> int:
    history: list[dict] = []
    print("Type a message; /bye or Ctrl-D to leave, /clear to forget the conversation.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/bye", "/exit", "/quit"):
            return 0
        if line.strip() == "/clear":
            history.clear()
            continue
        try:
            reply = _print_stream(chat.stream(line, params, history=history))
        except KeyboardInterrupt:
            print("\n(interrupted)", file=sys.stderr)
            continue
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]


def choose_chat(args) -> LocalChat | RemoteChat:
    """The running server when one answers (it loads the model once for everyone, as Ollama's run
    does); in-process otherwise, or for a .gguf path, which a server does not load by path."""
    from tokenmill.store.local import looks_like_path

    explicit = getattr(args, "server", None)
    base = server_url(explicit)
    if explicit or (not looks_like_path(args.model) and answers(base)):
        print(f"using the server at {base}", file=sys.stderr)
        given = {"num_predict": getattr(args, "max_tokens", None), "temperature": getattr(args, "temperature", None)}
        return RemoteChat(base, args.model, {k: v for k, v in given.items() if v is not None})
    reason = "a .gguf path" if looks_like_path(args.model) else f"no server answers at {base}"
    print(f"running {args.model} in-process ({reason})", file=sys.stderr)
    return LocalChat(args.model, args.dtype)


def cmd_run(args) -> int:
    from tokenmill.model import ModelLoadError
    from tokenmill.store import StoreError
    from tokenmill.tokenizer import TokenizerError

    # In-process defaults; a server gets only the flags given (RemoteChat).
    temperature = getattr(args, "temperature", None)
    params = SamplingParams(max_tokens=args.max_tokens if args.max_tokens is not None else 256,
                            temperature=temperature if temperature is not None else 0.0)
    try:
        prompt = piped_prompt(args.prompt)
        chat = choose_chat(args)
        if prompt is None or not prompt.strip():
            if isinstance(chat, RemoteChat):
                chat.load()
            # Nothing piped (`< /dev/null`): the model is loaded and checked, as Ollama's run does.
            return interactive(chat, params) if prompt is None else 0
        _print_stream(chat.stream(prompt, params, raw=args.raw))
        return 0
    except (StoreError, ModelLoadError, TokenizerError, RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
