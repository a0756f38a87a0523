"""Compiling grammars off the engine thread, with a time limit, and remembering recent ones.

The HTTP handler awaits `GrammarCompiler.compile`; the work runs on a small thread pool (llguidance
drops the GIL while it builds), so neither the event loop nor the engine loop waits on it. The
library's own fuel limits bound the work; the timeout is the backstop a client gets a 400 from."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from tokenmill.structured.grammar import Grammar, GrammarError, GrammarSpec
from tokenmill.structured.vocab import grammar_tokenizer
from tokenmill.tokenizer import Tokenizer

DEFAULT_TIMEOUT_S = 10.0
CACHE_SIZE = 64


class GrammarCompiler:
    """One per served model (its tokenizer)."""

    def __init__(self, tokenizer: Tokenizer, *, timeout_s: float = DEFAULT_TIMEOUT_S, max_workers: int = 2):
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tokenmill-grammar")
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile_now(self, spec: GrammarSpec) -> Grammar:
        """Compile on this thread (cached). Raises GrammarError."""
        key = _key(spec)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = Grammar(spec, grammar_tokenizer(self.tokenizer), self.tokenizer.vocab_size)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    async def compile(self, spec: GrammarSpec) -> Grammar:
        """Compile on the pool; GrammarError if it is invalid or takes longer than timeout_s."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, self.compile_now, spec)
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            raise GrammarError(f"the {spec.describe()} took longer than {self.timeout_s:g} s to compile") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _key(spec: GrammarSpec) -> str:
    thinking = None if spec.thinking is None else dataclasses.astuple(spec.thinking)
    return json.dumps([spec.kind, spec.value, thinking], sort_keys=True)


_compilers: "weakref.WeakKeyDictionary[Tokenizer, GrammarCompiler]" = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Tokenizer) -> GrammarCompiler:
    """The compiler (and its cache of grammars) of a loaded model, created on first use."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer)
        return compiler
