"""llama.cpp as a benchmark peer, through the `llama-cpp-python` package (a benchmark-only dependency:
`.venv/bin/pip install llama-cpp-python` compiles llama.cpp for this CPU).

The peer runs the same GGUF on the same token ids as tokenmill, greedily, for exactly the requested
number of tokens (EOS is never checked), through the low-level `eval` API: the high-level
`generate`/`__call__` paths would add prefix-cache reuse and sampler-chain work that tokenmill's side
does not do, and `generate` stops at EOS."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

INSTALL_HINT = ".venv/bin/pip install llama-cpp-python  (compiles llama.cpp for this CPU, ~10-20 min)"


class LlamaCppMissing(RuntimeError):
    """llama-cpp-python is not importable."""


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaCppMissing(f"llama-cpp-python is not installed ({exc}); install it with: {INSTALL_HINT}") from None
    return llama_cpp


def context_size(prompt_len: int, max_tokens: int, warmup_tokens: int = 8) -> int:
    """n_ctx that holds the longest sequence a benchmark runs (the timed prompt plus its new tokens, or
    the warm-up's prompt of the same length plus `warmup_tokens`), rounded up to 256 as llama.cpp pads."""
    need = prompt_len + max(max_tokens, warmup_tokens)
    return -(-need // 256) * 256


def describe() -> dict[str, Any]:
    """The package version and ggml's own view of this CPU (which SIMD paths it was compiled with)."""
    llama_cpp = import_llama_cpp()
    info = llama_cpp.llama_print_system_info()
    return {"llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
            "system_info": info.decode(errors="replace").strip() if isinstance(info, bytes) else str(info)}


@dataclass
class TimedGeneration:
    """One greedy run: start time, the wall time each new token became known, and the tokens."""
    t0: float
    token_times: list[float]
    token_ids: list[int]


class LlamaCppModel:
    """A GGUF loaded into llama.cpp for single-sequence greedy generation."""

    def __init__(self, gguf_path: str, *, threads: int, n_ctx: int, n_batch: int = 512, flash_attn: bool = False):
        llama_cpp = import_llama_cpp()
        import numpy as np

        self._np = np
        self._lib = llama_cpp
        self.n_ctx = n_ctx
        self.flash_attn = flash_attn
        start = time.perf_counter()
        # n_threads_batch too: it defaults to every CPU, while prompt processing must use the same
        # thread budget as tokenmill's prefill.
        self.llm = llama_cpp.Llama(model_path=gguf_path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                   n_batch=n_batch, flash_attn=flash_attn, verbose=False)
        self.load_seconds = time.perf_counter() - start
        self.vocab_size = self.llm.n_vocab()

    def _argmax_last(self, suppress: list[int]) -> int:
        # Only the batch's last position has logits (logits_all=False); read them in place, no copy
        # unless some ids must be excluded.
        ptr = self._lib.llama_get_logits_ith(self.llm.ctx, -1)
        logits = self._np.ctypeslib.as_array(ptr, shape=(self.vocab_size,))
        if suppress:
            logits = logits.copy()
            logits[suppress] = -self._np.inf
        return int(logits.argmax())

    def greedy(self, ids: list[int], n: int, suppress: list[int] | None = None) -> TimedGeneration:
        """Prefill `ids` (in n_batch chunks), then decode until `n` tokens exist; the last token is not
        fed back, as in tokenmill's engine. The KV cache is cleared first: nothing is reused.
        `suppress`: ids never picked (end-of-generation ids, as the engine excludes them with EOS ignored)."""
        if len(ids) + n > self.n_ctx:
            raise ValueError(f"prompt {len(ids)} + {n} new tokens exceed n_ctx {self.n_ctx}")
        self.llm.reset()
        times: list[float] = []
        out: list[int] = []
        t0 = time.perf_counter()
        self.llm.eval(ids)
        for i in range(n):
            if i:
                self.llm.eval([out[-1]])
            out.append(self._argmax_last(suppress or []))
            times.append(time.perf_counter())
        return TimedGeneration(t0, times, out)

    def close(self) -> None:
        self.llm.close()
