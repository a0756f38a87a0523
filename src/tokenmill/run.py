"""`tokenmill run MODEL [PROMPT]`: a one-shot answer, or an interactive chat that keeps the
conversation. Runs the engine in-process, or talks to a running server with --server."""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

from tokenmill.engine import EngineConfig, LLMEngine, OutputAssembler, SamplingParams


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
    """Streams /api/chat from a running tokenmill (or Ollama) server."""

    def __init__(self, base_url: str, model: str):
        self.base_url = base_url.rstrip("/")
        if "://" not in self.base_url:
            self.base_url = "http://" + self.base_url
        self.model = model

    def stream(self, prompt: str, params: SamplingParams, *, raw: bool = False,
               history: list[dict] | None = None) -> Iterator[str]:
        body = {"model": self.model, "stream": True,
                "messages": [*(history or []), {"role": "user", "content": prompt}],
                "options": {"temperature": params.temperature, "num_predict": params.max_tokens}}
        req = urllib.request.Request(self.base_url + "/api/chat", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req) as resp:
                for line in resp:
                    if not line.strip():
                        continue
                    obj = json.loads(line)
                    if "error" in obj:
                        raise RuntimeError(obj["error"])
                    yield obj.get("message", {}).get("content", "")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise RuntimeError(f"server answered {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:
            raise RuntimeError(f"cannot reach {self.base_url}: {exc.reason}") from None


def _print_stream(chunks: Iterator[str]) -> str:
    parts = []
    for text in chunks:
        parts.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(parts)


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


def cmd_run(args) -> int:
    from tokenmill.model import ModelLoadError
    from tokenmill.store import StoreError
    from tokenmill.tokenizer import TokenizerError

    params = SamplingParams(max_tokens=args.max_tokens, temperature=getattr(args, "temperature", 0.0))
    try:
        server = getattr(args, "server", None)
        chat = RemoteChat(server, args.model) if server else LocalChat(args.model, args.dtype)
        if args.prompt is None:
            return interactive(chat, params)
        _print_stream(chat.stream(args.prompt, params, raw=args.raw))
        return 0
    except (StoreError, ModelLoadError, TokenizerError, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
