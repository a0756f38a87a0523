"""The gguf weight mode (the default with the native kernels): weights stay in their GGUF blocks
and run through the quantized matmuls with int8-quantized activations (two planes), so the logits are close to,
not equal to, the fp32 PyTorch path's on the same file."""
from __future__ import annotations

import gguf
import pytest
import torch

from model_helpers import prefill_logits
from tiny_model import TinyGemma3Spec, TinyLlamaSpec, write_tiny_gemma3, write_tiny_llama
from tiny_spm import tiny_spm_metadata
from tokenmill.kernels import use_variant, variant
from tokenmill.model import load_model
from tokenmill.model.linear import Linear

Q = gguf.GGMLQuantizationType
PROMPT = torch.randint(6, 260, (40,), generator=torch.Generator().manual_seed(3)).tolist()
# Two-plane int8 activations and the bf16 cache cost ~0.1% of a logit's spread on these random models
# (one plane cost ~1%, and fails this bound); 0.5% leaves room.
REL_TOL = 0.005

native_only = pytest.mark.skipif(variant() == "torch", reason="native kernels not built")


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    spread = float(ref.max() - ref.min())
    err = float((got - ref).abs().max())
    assert err <= REL_TOL * spread, f"max |diff| {err:.4f} vs logit spread {spread:.4f}"


@native_only
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0])
@pytest.mark.parametrize("chunk", [None, 16])
def test_llama_gguf_logits_close_to_fp32(tmp_path, qtype, chunk):
    path = write_tiny_llama(tmp_path / f"tiny-{qtype.name}.gguf", TinyLlamaSpec(weight_type=qtype))
    with use_variant("torch"):
        ref = prefill_logits(load_model(path, "fp32").model, PROMPT)
    model = load_model(path, "gguf").model
    _close(prefill_logits(model, PROMPT, chunk=chunk, paged=True, kv_dtype=torch.bfloat16), ref)


@native_only
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0])
def test_gemma3_gguf_logits_close_to_fp32_across_the_window(tmp_path, qtype):
    path = write_tiny_gemma3(tmp_path / "g.gguf", tiny_spm_metadata(), TinyGemma3Spec(weight_type=qtype))
    with use_variant("torch"):
        ref = prefill_logits(load_model(path, "fp32").model, PROMPT)
    model = load_model(path, "gguf").model
    for chunk in (None, 7):
        _close(prefill_logits(model, PROMPT, chunk=chunk, paged=True, kv_dtype=torch.bfloat16), ref)


def test_gguf_mode_keeps_no_dense_copies(tmp_path):
    path = write_tiny_llama(tmp_path / "q.gguf", TinyLlamaSpec(weight_type=Q.Q4_1))
    loaded = load_model(path, "gguf")
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.quantized is not None and m.weight.numel() == 0 for m in linears)
    assert loaded.model.embed.numel() == 0 and loaded.model.head_quantized is not None
    assert loaded.weights == "gguf" and loaded.dtype == torch.float32


def test_auto_picks_gguf_with_native_kernels_and_a_dense_dtype_without(tiny_gguf):
    assert load_model(tiny_gguf).weights == ("dense" if variant() == "torch" else "gguf")
    with use_variant("torch"):
        assert load_model(tiny_gguf).weights == "dense"


@native_only
def test_long_context_beyond_256_blocks_runs_natively_and_stays_close(tmp_path):
    """4,200 tokens of context (263 blocks of 16: past the compiled graphs' 256-block limit), with a
    prompt chunked as the engine chunks it, then decode rows reading all of it."""
    path = write_tiny_llama(tmp_path / "long.gguf", TinyLlamaSpec(weight_type=Q.Q8_0, context_length=8192))
    ids = torch.randint(6, 260, (4200,), generator=torch.Generator().manual_seed(9)).tolist()
    with use_variant("torch"):
        ref = prefill_logits(load_model(path, "fp32").model, ids, chunk=512)
    _close(prefill_logits(load_model(path, "gguf").model, ids, chunk=512, paged=True, kv_dtype=torch.bfloat16), ref)


def _mapped_rss_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_DONTNEED"), reason="needs madvise")
def test_loading_leaves_the_files_pages_out_of_resident_memory(tmp_path):
    # Repacking reads every page of the file; once done they count against nobody but the page cache.
    path = write_tiny_llama(tmp_path / "r.gguf", TinyLlamaSpec(weight_type=Q.Q8_0, dim=256, ffn_dim=512))
    loaded = load_model(path, "gguf")
    assert _mapped_rss_kib(path.resolve()) == 0
    with torch.inference_mode():  # the embedding rows still read from the map, faulting pages back in
        ref = loaded.model.embed_rows.raw.dequantize()[torch.tensor([3, 9])]
        assert torch.equal(loaded.model.embed_tokens(torch.tensor([3, 9])), ref)
