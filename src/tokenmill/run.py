"""`tokenmill run MODEL [PROMPT]`: a one-shot answer, or an interactive chat that keeps the
conversation. Talks to a running server when one answers (TOKENMILL_HOST, or --server), else runs
the engine in-process."""
from __future__ import annotations

import argparse
import sys

from tokenmill.engine import SamplingParams
from tokenmill.run_chats import LocalChat, RemoteChat, Turn
from tokenmill.run_session import interactive, print_stream
from tokenmill.server_client import answers, server_url


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


def choose_chat(args) -> LocalChat | RemoteChat:
    """The running server when one answers (it loads the model once for everyone, as Ollama's run
    does); in-process otherwise, or for a .gguf path, which a server does not load by path."""
    from tokenmill.store.local import looks_like_path

    explicit = getattr(args, "server", None)
    base = server_url(explicit)
    given = {"num_predict": getattr(args, "max_tokens", None), "temperature": getattr(args, "temperature", None)}
    given = {k: v for k, v in given.items() if v is not None}  # the flags given: over a created model's PARAMETERs
    if explicit or (not looks_like_path(args.model) and answers(base)):
        print(f"using the server at {base}", file=sys.stderr)
        return RemoteChat(base, args.model, given, keep_alive=getattr(args, "keepalive", None))
    reason = "a .gguf path" if looks_like_path(args.model) else f"no server answers at {base}"
    print(f"running {args.model} in-process ({reason})", file=sys.stderr)
    if getattr(args, "keepalive", None) is not None:
        print("(--keepalive is for a server: this process holds the model until it exits)", file=sys.stderr)
    return LocalChat(args.model, args.dtype, options=given)


def _opened(args, model: str | None = None):
    """The chat for `model` (args.model unless given: the chat's /load), its model loaded and checked
    (as Ollama's run does before a prompt)."""
    if model is not None:
        args = argparse.Namespace(**{**vars(args), "model": model})
    chat = choose_chat(args)
    if isinstance(chat, RemoteChat):
        chat.load()
    return chat


def cmd_run(args) -> int:
    from tokenmill.model import ModelLoadError
    from tokenmill.store import StoreError
    from tokenmill.tokenizer import TokenizerError

    # In-process defaults; a server gets only the flags given (RemoteChat).
    temperature = getattr(args, "temperature", None)
    params = SamplingParams(max_tokens=args.max_tokens if args.max_tokens is not None else 256,
                            temperature=temperature if temperature is not None else 0.0)
    verbose, fmt = bool(getattr(args, "verbose", False)), getattr(args, "format", None)
    think = {"true": True, "false": False}.get(getattr(args, "think", None), getattr(args, "think", None))
    hide = bool(getattr(args, "hidethinking", False))
    try:
        prompt = piped_prompt(args.prompt)
        if prompt is None or not prompt.strip():
            chat = _opened(args)
            # Nothing piped (`< /dev/null`): the model is loaded and checked, and that is all.
            if prompt is not None:
                return 0
            return interactive(chat, params, lambda model: _opened(args, model), verbose=verbose, format=fmt,
                               think=think, hide_thinking=hide)
        chat = choose_chat(args)
        print_stream(chat.stream(Turn(prompt, format=fmt, raw=args.raw, think=think), params), hide)
        if verbose and chat.stats is not None:
            print("\n".join(chat.stats.lines()), file=sys.stderr)
        return 0
    except (StoreError, ModelLoadError, TokenizerError, RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
