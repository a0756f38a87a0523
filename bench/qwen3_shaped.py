"""Write a random-weight GGUF in the shape of Qwen3-0.6B-Q8_0 (28 layers, 1024 wide, 16 query heads and
8 key/value heads of 128, feed-forward 3072, 151,936 tokens, tied embeddings, Q8_0 matrices), for speed
measurements where the real file cannot be had (no Qwen file ships on PyPI). Its tokenizer is the byte
alphabet, a few merges, plain filler tokens up to the real vocabulary's size and Qwen's count of control
tokens, enough for llama.cpp
and tokenmill to load it; generation speed does not depend on the weights (bench with EOS ignored).

    python bench/qwen3_shaped.py /tmp/qwen3-0.6b-shaped.gguf
    tokenmill bench single-stream --model /tmp/qwen3-0.6b-shaped.gguf --peer llama-cpp --skip-hf --threads 2"""
from __future__ import annotations

import sys

import gguf
import numpy as np

from tokenmill.tokenizer.tokenizer import bytes_to_unicode

Q = gguf.GGMLQuantizationType
LAYERS, DIM, HEADS, KV_HEADS, HEAD, FFN, VOCAB = 28, 1024, 16, 8, 128, 3072, 151936
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _vocab() -> tuple[list[str], list[int], list[str]]:
    chars = list(bytes_to_unicode().values())
    tokens, types = list(chars), [int(gguf.TokenType.NORMAL)] * len(chars)
    merges = [f"{a} {b}" for a in chars[:40] for b in chars[:40]]
    tokens += [m.replace(" ", "") for m in merges]
    types += [int(gguf.TokenType.NORMAL)] * len(merges)
    # Qwen's 26 added tokens are control or user-defined; the rest of its vocabulary is plain pieces.
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(23)]
    plain = [f"zq{i}" for i in range(VOCAB - len(tokens) - len(specials))]
    tokens += plain + specials
    types += [int(gguf.TokenType.NORMAL)] * len(plain) + [int(gguf.TokenType.CONTROL)] * len(specials)
    return tokens, types, merges


def _q8_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_0]
    raw = rng.integers(-127, 128, size=(rows * cols // block, size), dtype=np.int8).view(np.uint8)
    raw[:, 0:2] = np.full((raw.shape[0], 1), 0.01, np.float16).view(np.uint8)  # a small finite scale a block
    return raw.reshape(rows, -1)


def write(path: str, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_name("Qwen3-0.6B shapes, random weights")
    w.add_block_count(LAYERS)
    w.add_context_length(40960)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD)
    w.add_value_length(HEAD)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    tokens, types, merges = _vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def matrix(name: str, rows: int, cols: int) -> None:
        data = _q8_0(rng, rows, cols)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=Q.Q8_0)

    def norm(name: str, size: int) -> None:
        w.add_tensor(name, (1.0 + rng.normal(0, 0.05, size)).astype(np.float32))

    matrix("token_embd.weight", VOCAB, DIM)
    for i in range(LAYERS):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", DIM)
        matrix(p + "attn_q.weight", HEADS * HEAD, DIM)
        matrix(p + "attn_k.weight", KV_HEADS * HEAD, DIM)
        matrix(p + "attn_v.weight", KV_HEADS * HEAD, DIM)
        norm(p + "attn_q_norm.weight", HEAD)
        norm(p + "attn_k_norm.weight", HEAD)
        matrix(p + "attn_output.weight", DIM, HEADS * HEAD)
        norm(p + "ffn_norm.weight", DIM)
        matrix(p + "ffn_gate.weight", FFN, DIM)
        matrix(p + "ffn_up.weight", FFN, DIM)
        matrix(p + "ffn_down.weight", DIM, FFN)
    norm("output_norm.weight", DIM)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else "/tmp/qwen3-0.6b-shaped.gguf")
