"""Many sequences decoding at once in llama.cpp, through llama-cpp-python's low-level API: one
`llama_batch` per step holding one token of each of N sequences (N seq ids), as llama.cpp's
`llama-batched-bench` does, but greedy (each step's tokens are the argmax of the last step's logits,
as tokenmill's engine picks them) rather than random ids.

The high-level `Llama` object cannot do this: its context holds one sequence."""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

from tokenmill.bench.llama_cpp_peer import amx_build_on_amx_cpu, import_llama_cpp


@dataclass
class BatchedRun:
    prefill_seconds: float  # all prompts, in n_batch chunks
    decode_seconds: float   # the timed decode steps
    decode_steps: int
    num_seqs: int

    @property
    def decode_tok_s(self) -> float:
        return self.num_seqs * self.decode_steps / self.decode_seconds


class LlamaCppBatched:
    """A GGUF in a llama.cpp context sized for `num_seqs` sequences of `max_len` tokens each."""

    def __init__(self, gguf_path: str, *, threads: int, num_seqs: int, max_len: int, n_batch: int = 2048,
                 n_ubatch: int = 512):
        import numpy as np

        self._np = np
        lib = self._lib = import_llama_cpp()
        lib.llama_backend_init()
        model_params = lib.llama_model_default_params()
        if amx_build_on_amx_cpu() and hasattr(model_params, "use_extra_bufts"):
            model_params.use_extra_bufts = False  # as LlamaCppModel: that build's AMX matmul faults here
        self.model = lib.llama_model_load_from_file(gguf_path.encode(), model_params)
        if not self.model:
            raise RuntimeError("llama.cpp could not load the model")
        params = lib.llama_context_default_params()
        params.n_ctx = num_seqs * (-(-max_len // 256) * 256)  # each sequence gets n_ctx / n_seq_max cells
        params.n_batch, params.n_ubatch, params.n_seq_max = n_batch, min(n_batch, n_ubatch), num_seqs
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise RuntimeError("llama.cpp could not create a context for the batch")
        self.num_seqs, self.n_batch = num_seqs, n_batch
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(max(n_batch, num_seqs), 0, 1)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) rows."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        rc = self._lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")

    def _argmax_rows(self, n: int) -> list[int]:
        """Greedy picks from the last decode's n output rows (in batch order)."""
        ptr = self._lib.llama_get_logits(self.ctx)
        logits = self._np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                             shape=(n, self.vocab_size))
        return logits.argmax(axis=1).tolist()

    def run(self, prompts: list[list[int]], decode_steps: int) -> BatchedRun:
        """Prefill every prompt (sequence j = prompts[j]), then `decode_steps` steps of one token per
        sequence. The memory is cleared first: nothing is reused between runs."""
        if len(prompts) != self.num_seqs:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.num_seqs} sequences")
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self.ctx), True)
        rows = [(tok, pos, j, pos == len(p) - 1) for j, p in enumerate(prompts) for pos, tok in enumerate(p)]
        t0 = time.perf_counter()
        last: list[int] = []
        for start in range(0, len(rows), self.n_batch):
            chunk = rows[start:start + self.n_batch]
            self._decode(chunk)
            last += self._argmax_rows(sum(1 for r in chunk if r[3]))
        t1 = time.perf_counter()
        lengths = [len(p) for p in prompts]
        for step in range(decode_steps):
            self._decode([(last[j], lengths[j] + step, j, True) for j in range(self.num_seqs)])
            last = self._argmax_rows(self.num_seqs)
        t2 = time.perf_counter()
        return BatchedRun(t1 - t0, t2 - t1, decode_steps, self.num_seqs)

    def close(self) -> None:
        self._lib.llama_batch_free(self.batch)
        self._lib.llama_free(self.ctx)
        self._lib.llama_model_free(self.model)
