"""The Llama model on tiny random GGUF models, against transformers loading the same file."""
from __future__ import annotations

import gguf
import pytest
import torch

from model_helpers import BLOCK, greedy, hf_model, new_cache, prefill_logits
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.model import AttentionMetadata, ChunkSpec, attention, load_model

Q = gguf.GGMLQuantizationType
PROMPT = [5, 77, 100, 3, 250, 9, 42, 42, 17, 200, 11, 60, 61, 62, 63, 64, 65, 90, 91, 92, 93]


@pytest.mark.parametrize("wtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_logits_match_transformers(tmp_path, wtype):
    path = write_tiny_llama(tmp_path / "m.gguf", TinyLlamaSpec(weight_type=wtype, tied_embeddings=wtype != Q.Q4_0))
    ours = load_model(path, torch.float32).model
    ref = hf_model(path)
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits[0, -1]
    got = prefill_logits(ours, PROMPT)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers(tiny_gguf):
    ours = load_model(tiny_gguf, torch.float32).model
    ref = hf_model(tiny_gguf)
    with torch.inference_mode():
        expected = ref.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
    assert greedy(ours, PROMPT, 24) == expected[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("chunk", [None, 550])
def test_long_prompt_matches_transformers(tmp_path, chunk):
    """Prompt chunks of PIECE_FROM tokens or more attend in query pieces rather than through SDPA:
    whole (no earlier context) and continued (the second chunk sees the first through the cache)."""
    assert 550 >= attention.PIECE_FROM and 550 % attention.PIECE != 0  # a ragged last piece too
    path = write_tiny_llama(tmp_path / "m.gguf", TinyLlamaSpec(context_length=2048))
    prompt = torch.randint(0, 256, (1100,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = load_model(path, torch.float32).model
    with torch.inference_mode():
        expected = hf_model(path)(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(ours, prompt, chunk=chunk), expected, atol=1e-4, rtol=1e-4)


def test_causal_pieces_match_masked_sdpa():
    torch.manual_seed(0)
    for n, length in [(300, 300), (129, 700), (1, 9)]:
        q, k, v = torch.randn(8, n, 32), torch.randn(2, length, 32), torch.randn(2, length, 32)
        mask = torch.arange(length)[None] <= torch.arange(length - n, length)[:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                                enable_gqa=True)[0]
        got = attention.causal_pieces(q.transpose(0, 1), k, v, 32 ** -0.5, torch.empty(n, 8, 32))
        torch.testing.assert_close(got.transpose(0, 1), ref, atol=1e-5, rtol=1e-5)


def test_causal_pieces_in_bf16_are_as_precise_as_flash_sdpa():
    """Scores of a realistic size (std ~3): rounding them to bf16 would multiply the error by 4-5."""
    torch.manual_seed(1)
    n = 512
    q, k, v = (torch.randn(n, 9, 64) * 2).bfloat16(), (torch.randn(3, n, 64) * 2).bfloat16(), torch.randn(3, n, 64).bfloat16()
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None].double(), k[None].double(),
                                                            v[None].double(), is_causal=True, enable_gqa=True)[0]
    flash = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                                              is_causal=True, enable_gqa=True)[0]
    ours = attention.causal_pieces(q, k, v, 64 ** -0.5, torch.empty_like(q)).transpose(0, 1)
    flash_err, our_err = (flash.double() - ref).abs().mean(), (ours.double() - ref).abs().mean()
    assert our_err < 1.5 * flash_err


def test_eager_decode_attention_in_bf16_is_as_precise_as_sdpa():
    """Decode rows outside the compiled graph (mixed steps, eager engines) keep float32 scores too."""
    torch.manual_seed(2)
    b, length, block = 8, 200, BLOCK
    per = -(-length // block)
    k_cache, v_cache = (torch.randn(3, b * per * block, 64) * 2).bfloat16(), torch.randn(3, b * per * block, 64).bfloat16()
    meta = AttentionMetadata.build([ChunkSpec(list(range(i * per, (i + 1) * per)), length - 1, 1) for i in range(b)], block)
    q = (torch.randn(b, 9, 64) * 2).bfloat16()
    k = k_cache.view(3, b, per * block, 64)[:, :, :length].transpose(0, 1)   # [B, Hkv, L, D]
    v = v_cache.view(3, b, per * block, 64)[:, :, :length].transpose(0, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(q[:, :, None].double(), k.double(), v.double(), enable_gqa=True)[:, :, 0]
    peer = sdpa(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    ours = attention.decode_attention(q, k_cache, v_cache, meta.decode, block, 64 ** -0.5)
    assert (ours.double() - ref).abs().mean() < 1.5 * (peer.double() - ref).abs().mean()


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_equals_whole_prefill(tiny_gguf, chunk):
    model = load_model(tiny_gguf, torch.float32).model
    torch.testing.assert_close(prefill_logits(model, PROMPT, chunk=chunk), prefill_logits(model, PROMPT),
                               atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_mixed_batch_equals_sequences_alone(tiny_gguf):
    """One flat batch holding a decode, a fresh prefill and a continued prefill computes, for each
    sequence, exactly what it computes alone."""
    model = load_model(tiny_gguf, torch.float32).model
    cfg = model.config
    prompts = [PROMPT[:7], PROMPT, PROMPT[3:20]]
    alone = [prefill_logits(model, p) for p in prompts]

    kv, _ = new_cache(cfg, 3 * 64, torch.float32)
    tables = [[0, 5, 9, 1], [2, 3], [11, 4, 7]]
    # Step 1: seq0 prefills all but its last token, seq2 prefills 10 tokens. seq1 waits.
    first = [ChunkSpec(tables[0], 0, 6), ChunkSpec(tables[2], 0, 10)]
    ids = prompts[0][:6] + prompts[2][:10]
    pos = list(range(6)) + list(range(10))
    model(torch.tensor(ids), torch.tensor(pos), AttentionMetadata.build(first, BLOCK), kv)
    # Step 2: seq0's last token (a one-token chunk), seq1 whole, seq2 the rest.
    chunks = [ChunkSpec(tables[0], 6, 1), ChunkSpec(tables[1], 0, len(prompts[1])), ChunkSpec(tables[2], 10, 7)]
    ids = prompts[0][6:] + prompts[1] + prompts[2][10:]
    pos = [6] + list(range(len(prompts[1]))) + list(range(10, 17))
    h = model(torch.tensor(ids), torch.tensor(pos), AttentionMetadata.build(chunks, BLOCK), kv)
    last_rows = torch.tensor([0, len(prompts[1]), len(ids) - 1])
    batched = model.logits(h, last_rows)
    for i in range(3):
        torch.testing.assert_close(batched[i], alone[i], atol=1e-5, rtol=1e-5)


def test_bf16_is_close(tiny_gguf):
    lm = load_model(tiny_gguf, "bf16")
    assert lm.dtype == torch.bfloat16 and lm.model.embed.dtype == torch.bfloat16
    ref = prefill_logits(load_model(tiny_gguf, torch.float32).model, PROMPT)
    got = prefill_logits(lm.model, PROMPT)
    assert (got - ref).abs().max() < 0.1
