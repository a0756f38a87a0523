"""Grammar libraries compared on our own tokenizers, to choose one for structured output (issue 14).

For each GGUF tokenizer (SmolLM2's byte-level BPE, 49,152 tokens; Gemma 3's SentencePiece, 262,144)
and each library: the time to build its view of the vocabulary (once per model), to compile one
JSON Schema (once per distinct schema) and to compute each token mask while walking a valid
document token by token. xgrammar is not a dependency; install it aside to run this:

    pip install --no-deps --target /tmp/xg xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
    PYTHONPATH=src:/tmp/xg python bench/grammar_libraries.py
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from tokenmill.store import resolve_model
from tokenmill.structured import grammar_tokenizer
from tokenmill.structured.grammar import JSON_OPTIONS
from tokenmill.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "required": ["street", "zip"],
                    "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["name", "age", "email", "tags", "address", "score"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["a", "ccc"],
            "address": {"street": "12 St James's Square", "zip": "12345"}, "score": 3.25}


def walk_llguidance(tok: Tokenizer, ids: list[int]) -> tuple[float, float, list[float]]:
    import llguidance

    start = time.perf_counter()
    lltok = grammar_tokenizer(tok)
    bridge = time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_OPTIONS))
    compile_s = time.perf_counter() - start
    assert not matcher.is_error(), matcher.get_error()
    mask = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)
    times = []
    for t in [*ids, None]:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        times.append(time.perf_counter() - start)
        if t is not None:
            assert (mask[t // 32] >> (t % 32)) & 1 and matcher.consume_token(t), tok.decode([t])
    assert matcher.is_accepting()
    return bridge, compile_s, times


def walk_xgrammar(tok: Tokenizer, ids: list[int]) -> tuple[float, float, list[float]]:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo([tok.token_bytes(i) for i in range(tok.vocab_size)], xgrammar.VocabType.RAW,
                                  vocab_size=tok.vocab_size, stop_token_ids=sorted(tok.stop_ids))
    compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    bridge = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    matcher = xgrammar.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - start
    mask = xgrammar.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in [*ids, None]:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - start)
        if t is not None:
            assert matcher.accept_token(t), tok.decode([t])
    return bridge, compile_s, times


def main() -> None:
    text = json.dumps(DOCUMENT)
    for name in sys.argv[1:] or ["smollm2", "gemma3:270m"]:
        tok = Tokenizer.from_file(resolve_model(name))
        ids = tok.encode(text, add_special_tokens=False)
        for lib, walk in (("llguidance", walk_llguidance), ("xgrammar", walk_xgrammar)):
            try:
                bridge, compile_s, times = walk(tok, ids)
            except ImportError:
                print(f"{name:12s} {lib:10s} not installed")
                continue
            us = sorted(t * 1e6 for t in times)
            print(f"{name:12s} vocab {tok.vocab_size:6d}  {lib:10s} vocabulary {bridge * 1e3:6.0f} ms  "
                  f"schema {compile_s * 1e3:7.1f} ms  mask/token median {statistics.median(us):5.0f} us "
                  f"p90 {us[int(len(us) * 0.9)]:5.0f} us  max {us[-1]:5.0f} us  ({len(us)} masks)")


if __name__ == "__main__":
    main()
