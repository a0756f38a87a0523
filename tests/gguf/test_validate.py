"""gguf/validate.py: real files pass, and every crafted file (counts, lengths, tensor types, offsets
and sizes a loader must not trust) is refused with a message that names neither the file's path nor
its bytes, reading only the header however large the file claims or is."""
from __future__ import annotations

import tracemalloc

import gguf
import numpy as np
import pytest

from crafted_gguf import crafted_variants
from hostile_gguf import DIM, DROP, VT, llama_tensors, minimal_llama_kvs, raw_gguf, small_llama, tensor_info
from tiny_model import TinyGemma3Spec, TinyLlamaSpec, write_tiny_gemma3, write_tiny_llama, write_tiny_qwen
from tiny_spm import tiny_spm_metadata
from tokenmill.gguf import GGUFError, open_gguf
from tokenmill.gguf.config import ModelConfig
from tokenmill.gguf.validate import InvalidGGUF, validate_gguf

ARCHS = ("llama", "gemma3")
Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("wtype", [Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_tiny_llama_files_pass_and_agree_with_the_reader(tmp_path, wtype):
    path = write_tiny_llama(tmp_path / "m.gguf", TinyLlamaSpec(weight_type=wtype))
    summary = validate_gguf(path, ARCHS)
    g = open_gguf(path)
    assert summary.architecture == "llama" and summary.version == 3
    assert summary.tensor_count == len(g.tensors) and summary.metadata_count >= len(g.metadata)
    assert summary.data_offset == g.data_offset and summary.file_size == path.stat().st_size


def test_tiny_gemma3_and_big_endian_files_pass(tmp_path):
    path = write_tiny_gemma3(tmp_path / "g.gguf", tiny_spm_metadata(), TinyGemma3Spec(weight_type=Q.Q8_0))
    assert validate_gguf(path, ARCHS).architecture == "gemma3"
    be = tmp_path / "be.gguf"
    small_llama(be, {"test.tokens": (["a", "bc"], VT.ARRAY)}, endianess=gguf.GGUFEndian.BIG)
    assert validate_gguf(be, ARCHS).tensor_count == len(llama_tensors())


def test_qwen_files_pass_and_a_missing_or_misshapen_bias_or_head_norm_is_refused(tmp_path):
    import dataclasses

    archs = ("qwen2", "qwen3")
    for arch in archs:
        assert validate_gguf(write_tiny_qwen(tmp_path / f"{arch}.gguf", arch), archs).architecture == arch
    # Written as Qwen2 (with biases) but named Qwen3: no head norms.
    spec = dataclasses.replace(TinyLlamaSpec(), qkv_bias=True)
    wrong = write_tiny_llama(tmp_path / "wrong.gguf", spec, arch="qwen3")
    with pytest.raises(InvalidGGUF, match=r"missing tensors \['blk.0.attn_q_norm.weight'"):
        validate_gguf(wrong, archs)
    # A Qwen2 whose k bias is not a key projection's size.
    g = open_gguf(tmp_path / "qwen2.gguf")
    shapes = {n: t.shape for n, t in g.tensors.items()}
    with pytest.raises(GGUFError, match=r"tensor blk.1.attn_k.bias has shape \[16\].*make it \[32\]"):
        ModelConfig.from_metadata("qwen2", g.metadata, {**shapes, "blk.1.attn_k.bias": (16,)}, "x")


def test_the_architecture_must_be_one_the_loader_has(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf")
    with pytest.raises(InvalidGGUF, match="unsupported architecture 'llama'.*gemma3"):
        validate_gguf(path, ("gemma3",))


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    valid = write_tiny_llama(tmp_path_factory.mktemp("valid") / "valid.gguf", TinyLlamaSpec())
    return crafted_variants(valid)


EXPECTED = {
    "not_gguf": "not a GGUF file", "empty": "not a GGUF file", "truncated": "past the end",
    "bad_version": "version 99", "tensor_offset_past_end": "past the end", "tensor_size_past_end": "past the end",
    "tensor_offset_huge": "past the end", "misaligned_tensor": "alignment", "overlapping_tensors": "overlaps",
    "unknown_tensor_type": "unknown ggml type 9999", "too_many_dims": "1000 dimensions",
    "huge_tensor_count": "limit", "huge_metadata_count": "limit", "huge_key_length": "limit",
    "huge_array_count": "limit", "huge_string_length": "limit", "unknown_architecture": "unsupported architecture",
    "tensor_elements_huge": "claims", "zero_dimension": "zero dimension",
    "offset_from_first": "past the end",
    "zero_head_count": "head_count is 0", "kv_heads_above_heads": "must divide attention.head_count",
    "huge_block_count": "more layers than the file has tensors", "huge_context_length": "context_length is 4294967295",
    "huge_rope_dimension": "rope.dimension_count is 2147483648", "nan_norm_eps": "layer_norm_rms_epsilon is nan",
    "zero_rope_base": "freq_base is 0.0",
}
HYPERPARAMETERS = ("zero_head_count", "kv_heads_above_heads", "huge_block_count", "huge_context_length",
                   "huge_rope_dimension", "nan_norm_eps", "zero_rope_base")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_crafted_files_are_refused_without_path_or_bytes(tmp_path, variants, name):
    path = tmp_path / "secret-dir" / "crafted.gguf"
    path.parent.mkdir()
    path.write_bytes(variants[name])
    with pytest.raises(InvalidGGUF) as info:
        validate_gguf(path, ARCHS)
    message = str(info.value)
    assert EXPECTED[name] in message, message
    assert "secret-dir" not in message and "crafted" not in message and "root:" not in message
    assert isinstance(info.value, GGUFError)


def test_every_crafted_variant_is_covered(variants):
    assert set(variants) == set(EXPECTED)


def test_the_loader_refuses_what_would_read_past_the_end(tmp_path, variants):
    # The reader is the last line: even a file that skipped validation cannot make it read out of bounds.
    for name in ("truncated", "tensor_offset_past_end", "tensor_size_past_end", "tensor_offset_huge",
                 "tensor_elements_huge", "offset_from_first", "huge_array_count", "huge_string_length",
                 "misaligned_tensor"):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(variants[name])
        with pytest.raises(GGUFError):
            open_gguf(path)


def test_the_loaders_config_refuses_hyperparameters_it_would_divide_by_or_allocate_for(tmp_path, variants):
    # A file that skipped validation (a local path, a blob checked before these checks) still fails
    # with a clear error before a model is built from its numbers.
    tracemalloc.start()
    try:
        for name in HYPERPARAMETERS:
            path = tmp_path / f"{name}.gguf"
            path.write_bytes(variants[name])
            with pytest.raises(GGUFError, match=EXPECTED[name].replace(".", r"\.")):
                ModelConfig.from_gguf(open_gguf(path))
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


def test_a_huge_file_is_checked_by_its_header_only(tmp_path):
    # A valid model followed by 8 GiB of (sparse) padding: the check reads the header, not the file,
    # and allocates nothing in proportion to the file's size.
    path = write_tiny_llama(tmp_path / "big.gguf")
    with path.open("r+b") as f:
        f.truncate(8 << 30)
    tracemalloc.start()
    try:
        summary = validate_gguf(path, ARCHS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert summary.file_size == 8 << 30
    assert peak < 8 << 20, peak


def test_a_metadata_array_of_many_strings_is_walked_not_kept(tmp_path):
    # 100,000 eight-byte strings: held as Python strings they would take ~6 MB; the check keeps none.
    path = tmp_path / "wide.gguf"
    small_llama(path, {"test.many": ([f"{i:08d}" for i in range(100_000)], VT.ARRAY)})
    tracemalloc.start()
    try:
        validate_gguf(path, ARCHS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


@pytest.mark.real_model
def test_real_models_pass(smollm2_path):
    summary = validate_gguf(smollm2_path, ARCHS)
    assert summary.architecture == "llama" and summary.tensor_count == len(open_gguf(smollm2_path).tensors)


@pytest.mark.real_model
def test_gemma3_passes(gemma3_path):
    assert validate_gguf(gemma3_path, ARCHS).architecture == "gemma3"


# --- files whose structure is sound but which no model can be made from --------------------------------

def refusal(tmp_path, metadata=None, tensors=None) -> str:
    """validate_gguf's message for the small Llama with these changes (the path never in it)."""
    path = tmp_path / "secret-dir" / "m.gguf"
    path.parent.mkdir(exist_ok=True)
    small_llama(path, metadata, tensors)
    with pytest.raises(InvalidGGUF) as info:
        validate_gguf(path, ARCHS)
    assert "secret-dir" not in str(info.value)
    return str(info.value)


def test_the_small_llama_passes(tmp_path):
    small_llama(tmp_path / "m.gguf")
    assert validate_gguf(tmp_path / "m.gguf", ARCHS).architecture == "llama"


@pytest.mark.parametrize(("metadata", "tensors", "expected"), [
    ({}, {"blk.0.ffn_up.weight": DROP}, "missing tensors ['blk.0.ffn_up.weight']"),
    ({}, {"output_norm.weight": DROP}, "missing tensors ['output_norm.weight']"),
    ({}, {"blk.0.attn_q.weight": np.zeros((16, DIM), np.float32)}, "blk.0.attn_q.weight has shape [16, 32]"),
    ({}, {"blk.0.attn_norm.weight": np.ones(DIM + 1, np.float32)}, "blk.0.attn_norm.weight has shape [33]"),
    # A vocab_size above the embedding's rows: those rows would have been uninitialised memory.
    ({"llama.vocab_size": 5000}, {}, "token_embd.weight has shape [271, 32]"),
    # Sizes that were allocated for before any tensor was read (2**31 x 32 floats: 256 GB).
    ({"llama.vocab_size": 2**31}, {}, "make it [2147483648, 32]"),
    ({"llama.feed_forward_length": 2**31}, {}, "make it [2147483648, 32]"),
    ({"llama.attention.head_count": 1, "llama.rope.dimension_count": 32}, {}, "blk.0.attn_k.weight has shape [16, 32]"),
    # Heads the attention kernels cannot run (every request was a 500 'head_dim must be a multiple of 16').
    ({"llama.attention.head_count": 8, "llama.attention.head_count_kv": 8, "llama.rope.dimension_count": 4}, {},
     "is 4: tokenmill's attention kernels need a multiple of 16"),
    # A rotary table of 2**20 positions x 4096 (32 GB), claimed by a 65 KB file.
    ({"llama.context_length": 2**20, "llama.attention.key_length": (4096, VT.UINT32),
      "llama.rope.dimension_count": 4096}, {}, "the rotary tables are limited"),
    ({"llama.context_length": 2**20, "llama.rope.dimension_count": 64}, {}, "must be even and 2 to the head size"),
])
def test_tensors_must_fit_the_hyperparameters(tmp_path, metadata, tensors, expected):
    assert expected in refusal(tmp_path, metadata, tensors)


@pytest.mark.parametrize(("metadata", "expected"), [
    ({"tokenizer.ggml.tokens": DROP}, "no vocabulary"),
    ({"tokenizer.ggml.tokens": ([], VT.ARRAY), "tokenizer.ggml.token_type": DROP}, "no vocabulary"),
    ({"tokenizer.ggml.tokens": (list(range(271)), VT.ARRAY)}, "tokenizer.ggml.tokens is not an array of strings"),
    ({"tokenizer.ggml.tokens": ("abc", VT.STRING)}, "tokenizer.ggml.tokens is not an array of strings"),
    ({"tokenizer.ggml.tokens": ([f"t{i}" for i in range(300)], VT.ARRAY), "tokenizer.ggml.token_type": DROP,
      "llama.vocab_size": DROP}, "make it [300, 32]"),
    ({"llama.vocab_size": DROP, "tokenizer.ggml.tokens": ([f"t{i}" for i in range(100)], VT.ARRAY),
      "tokenizer.ggml.token_type": DROP}, "make it [100, 32]"),
    ({"tokenizer.ggml.token_type": (["a"] * 271, VT.ARRAY)}, "token_type is not an array of integers"),
    ({"tokenizer.ggml.model": "bogus"}, "unsupported tokenizer.ggml.model='bogus'"),
    ({"tokenizer.ggml.model": DROP}, "unsupported tokenizer.ggml.model=None"),
    ({"tokenizer.ggml.model": "x" * 100_000}, "unsupported tokenizer.ggml.model='<a string of 100000 bytes>'"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.merges": DROP}, "needs tokenizer.ggml.scores"),
    ({"tokenizer.ggml.pre": "gpt9"}, "unsupported pre-tokenizer tokenizer.ggml.pre='gpt9'"),
    ({"tokenizer.ggml.merges": DROP}, "needs tokenizer.ggml.merges"),
    ({"tokenizer.ggml.merges": ([1, 2], VT.ARRAY)}, "tokenizer.ggml.merges is not an array of strings"),
])
def test_the_vocabulary_must_be_one_the_tokenizer_can_build(tmp_path, metadata, expected):
    # Each loaded and then failed on every request (a 500) before; now the push is refused.
    assert expected in refusal(tmp_path, metadata)


def test_a_tensor_type_the_loader_cannot_run_is_refused(tmp_path):
    # One IQ2_XXS block (256 values in 66 bytes): gguf knows the type, tokenmill's loader does not.
    path = tmp_path / "iq.gguf"
    path.write_bytes(raw_gguf(minimal_llama_kvs(), [tensor_info("w", (256,), Q.IQ2_XXS, 0)], b"\0" * 66))
    with pytest.raises(InvalidGGUF, match="tensor #0 has type IQ2_XXS, which tokenmill cannot run"):
        validate_gguf(path, ARCHS)


def test_a_huge_claimed_size_is_refused_without_allocating(tmp_path):
    small_llama(tmp_path / "m.gguf", {"llama.vocab_size": 2**31, "llama.feed_forward_length": 2**31})
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError, match="make it"):
            ModelConfig.from_gguf(open_gguf(tmp_path / "m.gguf"))  # the loader's own check
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_the_loaders_tensor_names_are_the_ones_checked():
    # config.py's tensor list (what validation checks) and the model classes' (what loading reads)
    # must agree, or a file could pass and still fail to load.
    from tokenmill.model.registry import ARCHITECTURES

    assert set(ARCHITECTURES) == {"llama", "smollm3", "gemma3", "qwen2", "qwen3", "phi3", "gemma2", "granite"}
    for arch, cls in ARCHITECTURES.items():
        for tied in (True, False):
            cfg = ModelConfig(arch, "t", vocab_size=8, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                              ffn_dim=64, context_length=16, norm_eps=1e-5, rope_theta=1e4, rope_dim=16,
                              tied_embeddings=tied)
            assert set(cfg.tensor_shapes()) == set(cls(cfg).gguf_tensor_names()), (arch, tied)
