"""LoRA adapters (gguf/lora.py) merged into a base GGUF (gguf/rewrite.py): the merged model's logits
are transformers' on the base weights plus alpha / rank * B @ A (written out in float by numpy), for
float and block-quantized bases, on the per-op path and the native kernels; the rest of the file is
the base's byte for byte; and adapters that do not fit are refused, naming tensors, not paths."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from model_helpers import hf_model, prefill_logits
from tiny_lora import TARGETS, write_lora, write_updated
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.gguf.lora import AdapterError, check_fits, merge, read_adapter
from tokenmill.gguf.reader import open_gguf
from tokenmill.gguf.rewrite import write_replaced
from tokenmill.model import load_model

Q = gguf.GGMLQuantizationType
PROMPT = [5, 77, 100, 3, 250, 9, 42, 42, 17, 200, 11, 60]


def merged_file(tmp_path, base, *adapters):
    g = open_gguf(base)
    parsed = [read_adapter(open_gguf(a)) for a in adapters]
    for a in parsed:
        check_fits(a, g)
    out = tmp_path / "merged.gguf"
    with open(out, "wb") as f:
        write_replaced(g, merge(g, parsed), f.write)
    return out


# A float base keeps its type (the merge is exact up to float32 rounding); a block type becomes Q8_0,
# whose rounding of the merged weights is what the looser bound allows for.
@pytest.mark.parametrize("wtype,tol", [(Q.F32, 1e-4), (Q.F16, 2e-3), (Q.Q8_0, 0.05), (Q.Q4_1, 0.05)])
def test_merged_logits_match_transformers_on_the_updated_weights(tmp_path, wtype, tol):
    base = write_tiny_llama(tmp_path / "base.gguf", TinyLlamaSpec(weight_type=wtype, tied_embeddings=False))
    targets = (*TARGETS, "output.weight")
    updates = write_lora(tmp_path / "a.gguf", base, targets, size=0.3)
    merged = merged_file(tmp_path, base, tmp_path / "a.gguf")
    with torch.inference_mode():
        expected = hf_model(write_updated(tmp_path / "ref.gguf", base, updates))(torch.tensor([PROMPT])).logits[0, -1]
    scale = expected.abs().max().item()
    for mode in ("fp32", "auto"):  # the per-op path, and the native kernels where they are built
        got = prefill_logits(load_model(merged, mode).model, PROMPT)
        assert (got - expected).abs().max().item() <= tol * scale, mode
        unadapted = prefill_logits(load_model(base, mode).model, PROMPT)
        assert (unadapted - expected).abs().max().item() > 0.2 * scale  # the adapter changed the model
    kinds = {t.name: t.ggml_type for t in open_gguf(merged).tensors.values()}
    want = wtype if wtype in (Q.F32, Q.F16) else Q.Q8_0
    assert {kinds[t] for t in targets} == {want}


def test_two_adapters_add_up_and_the_rest_of_the_file_is_the_base(tmp_path):
    base = write_tiny_llama(tmp_path / "base.gguf", TinyLlamaSpec(weight_type=Q.F32))
    first = write_lora(tmp_path / "a.gguf", base, TARGETS[:3], rank=2, alpha=4.0, seed=1)
    second = write_lora(tmp_path / "b.gguf", base, TARGETS[2:], rank=3, alpha=None, seed=2)  # no alpha: scale 1
    merged = open_gguf(merged_file(tmp_path, base, tmp_path / "a.gguf", tmp_path / "b.gguf"))
    g = open_gguf(base)
    assert merged.metadata == g.metadata and list(merged.tensors) == list(g.tensors)
    for name, t in g.tensors.items():
        got = np.asarray(merged.tensors[name].data)
        if name in TARGETS:
            want = np.asarray(t.data, np.float64) + first.get(name, 0) + second.get(name, 0)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert got.tobytes() == np.asarray(t.data).tobytes(), name


def test_greedy_tokens_of_a_merged_q4_model_on_the_native_path(tmp_path):
    """The merged file is an ordinary GGUF: the native step runs it as the per-op path does."""
    from model_helpers import assert_native_step_is_the_per_op_path
    from tokenmill.kernels import native

    if native.module() is None:
        pytest.skip("no native kernels built")
    base = write_tiny_llama(tmp_path / "base.gguf", TinyLlamaSpec(weight_type=Q.Q4_1))
    write_lora(tmp_path / "a.gguf", base, size=0.2)
    assert_native_step_is_the_per_op_path(merged_file(tmp_path, base, tmp_path / "a.gguf"), native.variant())


def _refusal(tmp_path, base, **kw) -> str:
    write_lora(tmp_path / "bad.gguf", base, **kw)
    with pytest.raises(AdapterError) as err:
        check_fits(read_adapter(open_gguf(tmp_path / "bad.gguf")), open_gguf(base))
    assert str(tmp_path) not in str(err.value)
    return str(err.value)


def test_adapters_that_do_not_fit_are_refused(tmp_path):
    base = write_tiny_llama(tmp_path / "base.gguf")
    other = write_tiny_llama(tmp_path / "wide.gguf", TinyLlamaSpec(dim=96, ffn_dim=160))
    assert "architecture 'qwen3'" in _refusal(tmp_path, base, arch="qwen3")
    write_lora(tmp_path / "wide-a.gguf", other, ("blk.0.attn_q.weight",))
    with pytest.raises(AdapterError, match="blk.0.attn_q.weight: the adapter's lora_b x lora_a is 96 x 96"):
        check_fits(read_adapter(open_gguf(tmp_path / "wide-a.gguf")), open_gguf(base))
    assert "token embeddings" in _refusal(tmp_path, base, targets=("token_embd.weight",))
    missing = _refusal(tmp_path, base, targets=(), extra={"blk.3.attn_q.weight.lora_a": np.zeros((2, 64), np.float32),
                                                          "blk.3.attn_q.weight.lora_b": np.zeros((64, 2), np.float32)})
    assert "'blk.3.attn_q.weight', which the base model does not have" in missing


@pytest.mark.parametrize("extra,message", [
    ({"blk.0.attn_q.weight.lora_a": np.zeros((2, 64), np.float32)}, "blk.0.attn_q.weight.lora_b is missing"),
    ({"blk.0.attn_q.weight.lora_a": np.zeros((2, 64), np.float32),
      "blk.0.attn_q.weight.lora_b": np.zeros((64, 3), np.float32)}, "lora_a has rank 2 but lora_b has rank 3"),
    ({"blk.0.attn_q.weight.lora_c": np.zeros((2, 64), np.float32)}, "is not named <tensor>.lora_a"),
    ({}, "adapts no tensor"),
])
def test_malformed_adapters_are_refused(tmp_path, extra, message):
    base = write_tiny_llama(tmp_path / "base.gguf")
    write_lora(tmp_path / "bad.gguf", base, targets=(), extra=extra)
    with pytest.raises(AdapterError, match=message):
        read_adapter(open_gguf(tmp_path / "bad.gguf"))


def test_a_model_is_not_an_adapter(tmp_path):
    base = write_tiny_llama(tmp_path / "base.gguf")
    with pytest.raises(AdapterError, match="not a LoRA adapter"):
        read_adapter(open_gguf(base))


def test_norm_adapters_are_skipped_as_llama_cpp_skips_them(tmp_path):
    base = write_tiny_llama(tmp_path / "base.gguf")
    write_lora(tmp_path / "a.gguf", base, ("blk.0.attn_q.weight",),
               extra={"blk.0.attn_norm.weight.lora_a": np.ones((1, 64), np.float32),
                      "blk.0.attn_norm.weight.lora_b": np.ones((1, 1), np.float32)})
    adapter = read_adapter(open_gguf(tmp_path / "a.gguf"))
    assert [p.base for p in adapter.pairs] == ["blk.0.attn_q.weight"]


@pytest.mark.parametrize("wtype", [Q.F32, Q.Q8_0])
def test_a_gemma3_adapter_matches_transformers_on_the_updated_weights(tmp_path, wtype):
    """Gemma 3's names and shapes (one KV head of 256, the gated FFN), across its local and global layers."""
    from tiny_model import TinyGemma3Spec, write_tiny_gemma3
    from tiny_spm import tiny_spm_metadata

    base = write_tiny_gemma3(tmp_path / "base.gguf", tiny_spm_metadata(), TinyGemma3Spec(weight_type=wtype))
    targets = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.5.attn_v.weight", "blk.5.attn_output.weight",
               "blk.6.ffn_gate.weight", "blk.6.ffn_down.weight")
    updates = write_lora(tmp_path / "a.gguf", base, targets, rank=8, alpha=16.0, size=0.3)
    merged = merged_file(tmp_path, base, tmp_path / "a.gguf")
    prompt = list(range(6, 46))  # longer than the local layers' window of 8
    with torch.inference_mode():
        expected = hf_model(write_updated(tmp_path / "ref.gguf", base, updates))(torch.tensor([prompt])).logits[0, -1]
    scale = expected.abs().max().item()
    got = prefill_logits(load_model(merged, "auto").model, prompt)
    assert (got - expected).abs().max().item() <= (1e-4 if wtype == Q.F32 else 0.05) * scale
    unadapted = prefill_logits(load_model(base, "auto").model, prompt)
    assert (unadapted - expected).abs().max().item() > 0.2 * scale


@pytest.mark.real_model
def test_merging_into_gemma3s_k_quant_and_q5_blocks_rounds_only_as_q8_0_does(gemma3_path, tmp_path):
    """Gemma 3 270M's own block types (Q4_K, Q6_K, Q5_0, Q8_0), which the tiny models cannot have: each
    merged weight is the dequantized base plus the update, within Q8_0's rounding of its block."""
    g = open_gguf(gemma3_path)
    targets = ("blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.1.ffn_down.weight", "blk.0.attn_q.weight",
               "blk.0.attn_v.weight")
    assert {g.tensors[t].ggml_type for t in targets} == {Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0}
    updates = write_lora(tmp_path / "a.gguf", gemma3_path, targets, rank=8, alpha=16.0, size=0.02)  # ~3 steps
    merged = merge(g, [read_adapter(open_gguf(tmp_path / "a.gguf"))])
    from tokenmill.gguf.weights import dequantize

    for name, update in updates.items():
        assert merged[name].ggml_type == Q.Q8_0
        want = dequantize(g.tensors[name], torch.float64).numpy() + update
        got = gguf.quants.dequantize(merged[name].make(), Q.Q8_0).astype(np.float64)
        blocks = np.abs(want).reshape(want.shape[0], -1, 32).max(axis=2, keepdims=True)
        err = np.abs(got - want).reshape(blocks.shape[0], -1, 32)
        # Half a Q8_0 step of its block, and the f16 rounding of the step the values were rounded with.
        assert (err <= blocks / 127 * 0.6 + 1e-6).all(), name
