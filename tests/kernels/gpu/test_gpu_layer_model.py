"""A tiny Llama, SmolLM3 (NoPE layers), Granite (multipliers), Gemma 3, Gemma 2 (soft-capped scores and logits), Qwen2 (q/k/v
biases), Qwen3 (q/k head norms) and Phi-3 (fused q/k/v and gate/up in the file; LongRoPE and partial
rotation here) forward on the GPU path's metadata (DeviceBatch) on CPU tensors,
every device op on its Triton kernel (interpreted here, compiled on CUDA): the layer's norms with their
residual steps, rotary embedding (with Gemma's head norms), gated activations, KV write and paged
attention. Held to the same steps on the PyTorch references: two prompts' prefills, then decode steps
of both together on fixed tokens (fixed, so that a near tie of a tiny random model cannot fork the
runs), logits within bf16 rounding."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import random_ids
from tiny_model import (TinyGemma3Spec, TinyLlamaSpec, write_tiny_gemma2, write_tiny_gemma3, write_tiny_llama,
                        write_tiny_phi3, write_tiny_qwen)
from tiny_spm import tiny_spm_metadata
from tokenmill.kernels.gpu import force
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import load_model
from tokenmill.model.attention import ChunkSpec
from tokenmill.model.gpu.batch import HostBatch, upload

BLOCK = 16


def steps(model, mode: str, prompts: list[list[int]], decode_tokens: list[list[int]]) -> list[torch.Tensor]:
    """Logits of each step: each prompt's prefill (its last row), then the decode steps of all prompts."""
    cfg = model.config
    kv = KVStorage(cfg.n_layers, 16, BLOCK, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16)
    tables = [[2 * i, 2 * i + 1] for i in range(len(prompts))]
    out = []
    with force(mode), torch.inference_mode():
        for p, table in zip(prompts, tables):
            step = upload(HostBatch.build([ChunkSpec(table, 0, len(p))], BLOCK), p, list(range(len(p))), [len(p) - 1],
                          BLOCK, "cpu")
            hidden = model(step.input_ids, step.positions, step.batch, kv)
            out.append(model.logits(hidden, step.sample_rows).float())
        lens = [len(p) for p in prompts]
        for tokens in decode_tokens:
            specs = [ChunkSpec(t, n, 1) for t, n in zip(tables, lens)]
            step = upload(HostBatch.build(specs, BLOCK), tokens, lens, list(range(len(tokens))), BLOCK, "cpu")
            hidden = model(step.input_ids, step.positions, step.batch, kv)
            out.append(model.logits(hidden, step.sample_rows).float())
            lens = [n + 1 for n in lens]
    return out


@pytest.mark.parametrize("arch", ["llama", "smollm3", "gemma3", "qwen2", "qwen3", "phi3", "gemma2", "granite"])
def test_the_kernels_compute_what_the_references_do(device, tmp_path, arch):
    if device != "cpu":
        pytest.skip("on CUDA, tests/engine/gpu runs the model's kernels end to end")
    if arch in ("llama", "smollm3", "granite"):
        floats = (("embedding_scale", 6.0), ("residual_scale", 0.3), ("attention.scale", 0.09), ("logit_scale", 4.0))
        spec = TinyLlamaSpec(context_length=256, n_layers=4, arch_floats=floats if arch == "granite" else ())
        path = write_tiny_llama(tmp_path / "t.gguf", spec, arch=arch)
    elif arch.startswith("qwen"):
        path = write_tiny_qwen(tmp_path / "q.gguf", arch, TinyLlamaSpec(context_length=256, head_dim=32))
    elif arch == "phi3":
        # with Phi-4-mini's LongRoPE and partial rotation (12 of 16 dims)
        longrope = ((1.0, 1.5, 2.0, 3.0, 4.0, 6.0), (1.0, 1.0, 1.1, 1.2, 1.4, 1.6), 16, 1.19)
        path = write_tiny_phi3(tmp_path / "p.gguf", TinyLlamaSpec(context_length=256, tied_embeddings=False,
                                                                  longrope=longrope, rope_dim=12))
    elif arch == "gemma2":
        path = write_tiny_gemma2(tmp_path / "g.gguf", tiny_spm_metadata(), TinyGemma3Spec(n_layers=4, context_length=256))
    else:
        path = write_tiny_gemma3(tmp_path / "g.gguf", tiny_spm_metadata(), TinyGemma3Spec(context_length=256))
    model = load_model(path, torch.bfloat16).model
    prompts = [random_ids(9, seed=1), random_ids(3, seed=2)]
    decode_tokens = [[random_ids(1, seed=10 + i)[0], random_ids(1, seed=20 + i)[0]] for i in range(3)]
    want = steps(model, "reference", prompts, decode_tokens)
    got = steps(model, "triton", prompts, decode_tokens)
    worst = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(want, got))
    # bf16 activations, the interpreter rounding toward zero where the references round to nearest
    assert worst < 0.05, worst
