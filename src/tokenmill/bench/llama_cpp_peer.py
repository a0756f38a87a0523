"""llama.cpp as a benchmark peer, through the `llama-cpp-python` package (a benchmark-only dependency:
`.venv/bin/pip install llama-cpp-python` compiles llama.cpp for this CPU).

The peer runs the same GGUF on the same token ids as tokenmill, greedily, for exactly the requested
number of tokens (EOS is never checked), through the low-level `eval` API: the high-level
`generate`/`__call__` paths would add prefix-cache reuse and sampler-chain work that tokenmill's side
does not do, and `generate` stops at EOS."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
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
    text = info.decode(errors="replace").strip() if isinstance(info, bytes) else str(info)
    out = {"llama_cpp_python": getattr(llama_cpp, "__version__", "?"), "system_info": text}
    if "AMX_INT8 = 1" in text:
        from tokenmill.bench.common import cpu_flags

        if "amx_int8" in cpu_flags():
            out["extra_buffer_types"] = "off (its AMX matmul faults on this CPU)"
    return out


def amx_build_on_amx_cpu() -> bool:
    """Whether this llama.cpp was built with its AMX matmul and the CPU has AMX: that matmul (one of
    llama.cpp's extra buffer types) dies with a protection fault at its first tile load on the Xeons
    tokenmill is measured on (README, llama.cpp as the peer), so the peers turn the extra buffer types
    off there (without_extra_buffer_types)."""
    return "extra_buffer_types" in describe()


@contextlib.contextmanager
def without_extra_buffer_types() -> Iterator[None]:
    """llama.cpp models loaded inside are loaded without its extra buffer types (weight repacking,
    the AMX matmul): llama-cpp-python's Llama takes its model parameters from the low-level module's
    defaults, which this patches for the duration. SmolLM2's Q4_1 weights are not repacked on
    AVX-512 anyway; K-quants lose llama.cpp's repacked layout."""
    low_level = import_llama_cpp().llama_cpp
    defaults = low_level.llama_model_default_params

    def params_without():
        params = defaults()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = params_without
    try:
        yield
    finally:
        low_level.llama_model_default_params = defaults


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
        # Where llama.cpp's AMX matmul would crash, without its extra buffer types (said in `describe`).
        self.extra_buffer_types = not amx_build_on_amx_cpu()
        # n_threads_batch too: it defaults to every CPU, while prompt processing must use the same
        # thread budget as tokenmill's prefill.
        with contextlib.nullcontext() if self.extra_buffer_types else without_extra_buffer_types():
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
        self._check_room(ids, n)
        self.llm.reset()
        return self._decode(ids, n, suppress or [], ())

    def greedy_continuing(self, ids: list[int], n: int, stop_ids: list[int]) -> tuple[TimedGeneration, int]:
        """A chat turn: keep the longest common prefix of the context and `ids` (never its last token,
        whose logits are wanted), as llama-server's slot and llama-cpp-python's `generate` reuse it,
        evaluate the rest, then decode until a stop id or `n` tokens (the last one not fed back).
        Returns the run and how many of ids' tokens were reused."""
        self._check_room(ids, n)
        reused = 0
        for have, want in zip(self.llm.input_ids[: self.llm.n_tokens].tolist(), ids[:-1]):
            if have != want:
                break
            reused += 1
        self.llm.n_tokens = reused  # eval() drops the KV cells from here on
        return self._decode(ids[reused:], n, [], stop_ids), reused

    def _check_room(self, ids: list[int], n: int) -> None:
        if len(ids) + n > self.n_ctx:
            raise ValueError(f"prompt {len(ids)} + {n} new tokens exceed n_ctx {self.n_ctx}")

    def _decode(self, ids: list[int], n: int, suppress: list[int], stop_ids) -> TimedGeneration:
        """Evaluate ids after the context, then take greedy tokens until `n` or a stop id (the last token
        is not fed back, as in tokenmill's engine)."""
        times: list[float] = []
        out: list[int] = []
        t0 = time.perf_counter()
        self.llm.eval(ids)
        for i in range(n):
            if i:
                self.llm.eval([out[-1]])
            out.append(self._argmax_last(suppress))
            times.append(time.perf_counter())
            if out[-1] in stop_ids:
                break
        return TimedGeneration(t0, times, out)

    def close(self) -> None:
        self.llm.close()
