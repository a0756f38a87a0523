"""The native decoder step (model/native_step.py, csrc/decoder_step.cpp) runs every layer in one
call; it must give bitwise the hidden states of the per-op path it replaces, on every variant, cache
dtype and batch shape, and step aside whenever some part of the model cannot run natively."""
from __future__ import annotations

import gguf
import pytest
import torch

from model_helpers import BLOCK
from tiny_model import TinyGemma3Spec, TinyLlamaSpec, write_tiny_gemma3, write_tiny_llama
from tiny_spm import tiny_spm_metadata
from tokenmill.kernels import head_argmax, native, use_variant
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import ChunkSpec, load_model, native_step
from tokenmill.model.paged_batch import PagedBatch

Q = gguf.GGMLQuantizationType
VARIANTS = native.runnable_variants()
pytestmark = pytest.mark.skipif(not VARIANTS, reason="native kernels not built")
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def _steps(prompts: list[list[int]]) -> list[list[tuple[int, int, int]]]:
    """Steps of (sequence, start, count): each prompt in awkward chunks, the second step mixing two
    sequences' chunks, then three decode steps of every sequence together."""
    a, b = prompts
    steps = [[(0, 0, 21)], [(0, 21, len(a) - 21), (1, 0, 17)], [(1, 17, len(b) - 17)]]
    for i in range(3):
        steps.append([(0, len(a) + i, 1), (1, len(b) + i, 1)])
    return steps


@torch.inference_mode()
def _run(model, prompts: list[list[int]], kv_dtype: torch.dtype) -> list[torch.Tensor]:
    cfg = model.config
    tokens = [p + [7, 9, 11] for p in prompts]
    per_seq = -(-max(len(t) for t in tokens) // BLOCK)
    kv = KVStorage(cfg.n_layers, 2 * per_seq, BLOCK, cfg.n_kv_heads, cfg.head_dim, kv_dtype, lazy=True)
    # Interleaved, reversed block ids: nothing passes by accident on contiguous slots.
    tables = [list(range(2 * per_seq - 1, -1, -2)), list(range(2 * per_seq - 2, -1, -2))]
    hidden = []
    for step in _steps(prompts):
        ids = [t for s, start, n in step for t in tokens[s][start:start + n]]
        positions = [p for _, start, n in step for p in range(start, start + n)]
        meta = PagedBatch.build([ChunkSpec(tables[s], start, n) for s, start, n in step], BLOCK)
        out = model(torch.tensor(ids), torch.tensor(positions), meta, kv)
        # The logits as the runner asks for them: every row, then the rows that sample (each chunk's last).
        last = torch.tensor([sum(n for _, _, n in step[:i + 1]) - 1 for i in range(len(step))])
        logits = (model.logits(out), model.logits(out, last))
        hidden += [out.clone(), *logits]
    return hidden


def _assert_native_matches_per_op(model, kv_dtype: torch.dtype, prompts: list[list[int]]) -> None:
    got = _run(model, prompts, kv_dtype)
    with native_step.disabled():
        want = _run(model, prompts, kv_dtype)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {i // 3} ({['hidden', 'logits', 'sampled logits'][i % 3]}): max |diff| " \
                                  f"{float((g - w).abs().max())}"


PROMPTS = [torch.randint(6, 260, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 29)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_llama_native_step_is_bitwise_the_per_op_path(tmp_path, variant, kv_dtype, qtype):
    path = write_tiny_llama(tmp_path / "t.gguf", TinyLlamaSpec(weight_type=qtype))
    with use_variant(variant):
        model = load_model(path, "gguf").model
        _assert_native_matches_per_op(model, kv_dtype, PROMPTS)
        assert model.native_steps.get(model, PagedBatch.build([ChunkSpec([0], 0, 1)], BLOCK),
                                      KVStorage(2, 1, BLOCK, 2, 16, kv_dtype), torch.zeros(1)) is not None


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_gemma3_native_step_is_bitwise_the_per_op_path_across_windows(tmp_path, variant, kv_dtype):
    # 40 tokens against a window of 8: local layers read only their window's blocks.
    path = write_tiny_gemma3(tmp_path / "g.gguf", tiny_spm_metadata(), TinyGemma3Spec(weight_type=Q.Q5_0))
    with use_variant(variant):
        _assert_native_matches_per_op(load_model(path, "gguf").model, kv_dtype, PROMPTS)


def test_logits_take_the_native_head_only_for_what_the_native_step_returned(tmp_path):
    path = write_tiny_llama(tmp_path / "t.gguf", TinyLlamaSpec(weight_type=Q.Q8_0))
    model = load_model(path, "gguf").model
    cfg = model.config
    kv = KVStorage(cfg.n_layers, 4, BLOCK, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16)
    meta = PagedBatch.build([ChunkSpec([0, 1], 0, 5)], BLOCK)
    with torch.inference_mode():
        hidden = model(torch.tensor([5, 6, 7, 8, 9]), torch.arange(5), meta, kv)
        step = model.native_steps.head_for(hidden)
        assert step is not None and step.has_head
        assert model.native_steps.head_for(hidden.clone()) is None  # a copy is any tensor: the per-op path
        with pytest.raises(IndexError, match="outside the step"):
            step.logits(hidden, torch.tensor([5]))
        assert torch.equal(model.logits(hidden, torch.tensor([4, 0])), model.logits(hidden.clone(), torch.tensor([4, 0])))


@pytest.mark.skipif(native.variant() != "avx512", reason="the bounded head kernel is AVX-512 only")
@pytest.mark.parametrize("which", ["llama", "gemma3"])
def test_greedy_tokens_take_the_norm_and_the_bounded_head_in_one_native_call(tmp_path, monkeypatch, which):
    # NativeStep.greedy: the final norm, the quantization and the bounded head kernel on what the
    # native step returned, bitwise GreedyHead(final_hidden(...)) for any rows, suppressed ids and
    # with the 6-bit copy; the model takes it for exactly what the native step returned.
    monkeypatch.setattr(head_argmax, "_ENABLED", True)
    if which == "llama":
        path = write_tiny_llama(tmp_path / "t.gguf", TinyLlamaSpec(weight_type=Q.Q8_0))
    else:
        path = write_tiny_gemma3(tmp_path / "g.gguf", tiny_spm_metadata(), TinyGemma3Spec(weight_type=Q.Q8_0))
    model = load_model(path, "gguf").model
    cfg = model.config
    kv = KVStorage(cfg.n_layers, 4, BLOCK, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16)
    meta = PagedBatch.build([ChunkSpec([0, 1], 0, 5)], BLOCK)
    weight = model.head_quantized.parts[0][0]
    calls = []
    real = native_step.NativeStep.greedy
    monkeypatch.setattr(native_step.NativeStep, "greedy", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        hidden = model(torch.tensor([5, 6, 7, 8, 9]), torch.arange(5), meta, kv)
        step = model.native_steps.head_for(hidden)
        assert step is not None and step.has_greedy
        for coarse in (False, True):
            head = head_argmax.GreedyHead(weight, coarse=coarse)
            assert head.native and (head.coarse is not None) == coarse
            for rows in (None, [4, 0], [2]):
                indices = None if rows is None else torch.tensor(rows)
                for exclude in ((), (int(head(model.final_hidden(hidden, indices))[0]), 3)):
                    got = step.greedy(hidden, indices, head, exclude)
                    want = head(model.final_hidden(hidden, indices).float(), exclude)
                    assert torch.equal(got, want), (coarse, rows, exclude)
            with pytest.raises(IndexError, match="outside the step"):
                step.greedy(hidden, torch.tensor([5]), head)
        other = load_model(path, "gguf").model.head_quantized.parts[0][0]
        with pytest.raises(ValueError, match="not that one Q8_0 weight"):
            step.greedy(hidden, None, head_argmax.GreedyHead(other))
        calls.clear()
        assert torch.equal(model.greedy_tokens(hidden, torch.tensor([4, 1])),
                           model.greedy_tokens(hidden.clone(), torch.tensor([4, 1])))
        assert calls == [1]  # the copy is any tensor: it took the per-op path


def test_a_model_with_dense_parts_runs_per_op(tmp_path):
    # F32 matrices are not a qmatmul type: the gguf mode keeps them dense, so the native step steps aside.
    path = write_tiny_llama(tmp_path / "f.gguf", TinyLlamaSpec(weight_type=Q.F32))
    model = load_model(path, "gguf").model
    kv = KVStorage(model.config.n_layers, 8, BLOCK, model.config.n_kv_heads, model.config.head_dim, torch.bfloat16)
    meta = PagedBatch.build([ChunkSpec(list(range(8)), 0, 5)], BLOCK)
    assert model.native_steps.get(model, meta, kv, torch.zeros(1)) is None
    with torch.inference_mode():
        assert model(torch.tensor([5, 6, 7, 8, 9]), torch.arange(5), meta, kv).shape == (5, model.config.dim)


def test_a_new_kv_storage_gets_a_step_bound_to_it(tmp_path):
    path = write_tiny_llama(tmp_path / "t.gguf", TinyLlamaSpec(weight_type=Q.Q8_0))
    model = load_model(path, "gguf").model
    cfg = model.config
    meta = PagedBatch.build([ChunkSpec([0], 0, 1)], BLOCK)
    first_kv, second_kv = (KVStorage(cfg.n_layers, 4, BLOCK, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16) for _ in "ab")
    first = model.native_steps.get(model, meta, first_kv, torch.zeros(1))
    assert model.native_steps.get(model, meta, first_kv, torch.zeros(1)) is first
    second = model.native_steps.get(model, meta, second_kv, torch.zeros(1))
    assert second is not None and second is not first and second.kv() is second_kv


def test_positions_beyond_the_rotary_table_are_refused(tmp_path):
    path = write_tiny_llama(tmp_path / "t.gguf", TinyLlamaSpec(weight_type=Q.Q8_0, context_length=64))
    model = load_model(path, "gguf").model
    kv = KVStorage(model.config.n_layers, 8, BLOCK, model.config.n_kv_heads, model.config.head_dim, torch.bfloat16)
    meta = PagedBatch.build([ChunkSpec(list(range(8)), 64, 1)], BLOCK)
    with torch.inference_mode(), pytest.raises(ValueError, match="rotary table"):
        model(torch.tensor([5]), torch.tensor([64]), meta, kv)


@pytest.mark.real_model
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_models_native_step_is_bitwise_the_per_op_path(request, which):
    # The real files mix block types within a projection (Gemma 3: Q5_0 q/k with Q8_0 v).
    path = request.getfixturevalue(f"{which}_path")
    model = load_model(path, "gguf").model
    prompts = [torch.randint(100, 5000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 45)]
    _assert_native_matches_per_op(model, torch.bfloat16, prompts)
