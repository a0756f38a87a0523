"""Write tiny random models as real GGUF files, so unit tests exercise the same loading path as
production without a multi-MB download."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import quants

from tiny_spm import add_metadata
from tokenmill.tokenizer.tokenizer import bytes_to_unicode

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A chat template in the same shape as SmolLM2's (ChatML).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A few byte-level merges so the BPE actually merges something.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
          ("Ġ", "s"), ("l", "l"), ("e", "ll"), ("h", "ell"), ("hell", "o")]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = list(SPECIAL_TOKENS)
    types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
    for ch in bytes_to_unicode().values():
        tokens.append(ch)
        types.append(gguf.TokenType.NORMAL)
    for a, b in MERGES:
        tokens.append(a + b)
        types.append(gguf.TokenType.NORMAL)
    return tokens, [int(t) for t in types], [f"{a} {b}" for a, b in MERGES]


@dataclass
class TinyLlamaSpec:
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    context_length: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied_embeddings: bool = True
    # GGML type for the 2-D weight matrices; norms stay F32 as in real files.
    weight_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32
    seed: int = 0
    file_type: int | None = None  # general.file_type; None: the weight type's number
    # Qwen's differences (write_tiny_qwen sets them): a head size other than dim / heads (key_length),
    # RMSNorms over each q and k head (Qwen3), biases on q, k and v (Qwen2).
    head_dim: int | None = None
    qk_norm: bool = False
    qkv_bias: bool = False
    tokenizer_pre: str = "smollm"
    # Rotary scaling: Llama 3.1's per-frequency divisors (the rope_freqs tensor), or a scaling type and factor.
    rope_freqs: tuple[float, ...] | None = None
    rope_scaling: tuple[str, float] | None = None
    rope_original_context: int | None = None  # rope.scaling.original_context_length (YaRN's)
    # Float keys under the architecture's prefix (Granite's "embedding_scale", "attention.scale", ...).
    arch_floats: tuple[tuple[str, float], ...] = ()
    # Phi-3's files: q, k, v in one tensor (attn_qkv), the gate above the up projection in one (ffn_up);
    # the sliding-window key Phi-3-mini-4k's carry; LongRoPE (Phi-3.5, Phi-4-mini): (long factors, short
    # factors, original context, attention factor); rotary dims of a head (Phi-4-mini's 3/4; None: all).
    fused: bool = False
    sliding_window: int | None = None
    longrope: tuple[tuple[float, ...], tuple[float, ...], int, float] | None = None
    rope_dim: int | None = None
    # Tokens appended to the vocabulary as user-defined ones (Qwen3's "<think>" and "</think>"): one id
    # each, whole in the text they stand for, as its added tokens are.
    added_tokens: tuple[str, ...] = ()


def _add(writer: gguf.GGUFWriter, name: str, arr: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
    arr = arr.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, arr)
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, arr.astype(np.float16))
    else:
        data = quants.quantize(arr, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def write_tiny_llama(path: Path | str, spec: TinyLlamaSpec | None = None, *, arch: str = "llama",
                     chat_template: str | None = CHATML_TEMPLATE, tokenizer: dict | None = None) -> Path:
    """`tokenizer`: the tokenizer.ggml.* metadata to write instead of the byte-level tiny vocabulary
    (a SentencePiece one from tiny_spm.py, say)."""
    spec = spec or TinyLlamaSpec()
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, types, merges = tiny_vocab()
    tokens, types = tokens + list(spec.added_tokens), types + [int(gguf.TokenType.USER_DEFINED)] * len(spec.added_tokens)
    if tokenizer is not None:
        tokens = tokenizer["tokenizer.ggml.tokens"]
    vocab = len(tokens)
    head_dim = spec.head_dim or spec.dim // spec.n_heads

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-random-llama")
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.dim)
    w.add_feed_forward_length(spec.ffn_dim)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_rope_dimension_count(spec.rope_dim or head_dim)
    if spec.head_dim:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if spec.rope_scaling:
        w.add_string(gguf.Keys.Rope.SCALING_TYPE.format(arch=arch), spec.rope_scaling[0])
        w.add_rope_scaling_factor(spec.rope_scaling[1])
    if spec.rope_original_context is not None:
        w.add_rope_scaling_orig_ctx_len(spec.rope_original_context)
    if spec.sliding_window is not None:
        w.add_sliding_window(spec.sliding_window)
    for key, value in spec.arch_floats:
        w.add_float32(f"{arch}.{key}", value)
    if spec.longrope is not None:
        w.add_rope_scaling_orig_ctx_len(spec.longrope[2])
        w.add_rope_scaling_attn_factors(spec.longrope[3])
    w.add_vocab_size(vocab)
    w.add_file_type(int(spec.weight_type) if spec.file_type is None else spec.file_type)
    if tokenizer is not None:
        add_metadata(w, tokenizer)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(spec.tokenizer_pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_pad_token_id(2)
        w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, 0.08, size=(rows, cols))

    wt = spec.weight_type
    _add(w, "token_embd.weight", mat(vocab, spec.dim), wt)
    if spec.rope_freqs is not None:
        _add(w, "rope_freqs.weight", np.array(spec.rope_freqs), gguf.GGMLQuantizationType.F32)
    if spec.longrope is not None:
        _add(w, "rope_factors_long.weight", np.array(spec.longrope[0]), gguf.GGMLQuantizationType.F32)
        _add(w, "rope_factors_short.weight", np.array(spec.longrope[1]), gguf.GGMLQuantizationType.F32)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        _add(w, p + "attn_norm.weight", 1.0 + rng.normal(0, 0.05, spec.dim), gguf.GGMLQuantizationType.F32)
        qkv = [mat(heads * head_dim, spec.dim) for heads in (spec.n_heads, spec.n_kv_heads, spec.n_kv_heads)]
        if spec.fused:
            _add(w, p + "attn_qkv.weight", np.concatenate(qkv), wt)
        else:
            for name, part in zip(("attn_q", "attn_k", "attn_v"), qkv):
                _add(w, p + name + ".weight", part, wt)
        _add(w, p + "attn_output.weight", mat(spec.dim, spec.n_heads * head_dim), wt)
        if spec.qk_norm:
            for name in ("attn_q_norm", "attn_k_norm"):
                _add(w, p + name + ".weight", 1.0 + rng.normal(0, 0.1, head_dim), gguf.GGMLQuantizationType.F32)
        if spec.qkv_bias:
            for name, heads in (("attn_q", spec.n_heads), ("attn_k", spec.n_kv_heads), ("attn_v", spec.n_kv_heads)):
                _add(w, p + name + ".bias", rng.normal(0, 0.2, heads * head_dim), gguf.GGMLQuantizationType.F32)
        _add(w, p + "ffn_norm.weight", 1.0 + rng.normal(0, 0.05, spec.dim), gguf.GGMLQuantizationType.F32)
        gate, up = mat(spec.ffn_dim, spec.dim), mat(spec.ffn_dim, spec.dim)
        if spec.fused:
            _add(w, p + "ffn_up.weight", np.concatenate([gate, up]), wt)
        else:
            _add(w, p + "ffn_gate.weight", gate, wt)
            _add(w, p + "ffn_up.weight", up, wt)
        _add(w, p + "ffn_down.weight", mat(spec.dim, spec.ffn_dim), wt)
    _add(w, "output_norm.weight", 1.0 + rng.normal(0, 0.05, spec.dim), gguf.GGMLQuantizationType.F32)
    if not spec.tied_embeddings:
        _add(w, "output.weight", mat(vocab, spec.dim), wt)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_qwen(path: Path | str, arch: str, spec: TinyLlamaSpec | None = None,
                    chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """A tiny random Qwen2 (q/k/v biases) or Qwen3 (q/k head norms) file, with Qwen's pre-tokenizer."""
    from dataclasses import replace

    spec = replace(spec or TinyLlamaSpec(), qk_norm=arch == "qwen3", qkv_bias=arch == "qwen2", tokenizer_pre="qwen2")
    return write_tiny_llama(path, spec, arch=arch, chat_template=chat_template)


def write_tiny_phi3(path: Path | str, spec: TinyLlamaSpec | None = None) -> Path:
    """A tiny random Phi-3 file: fused q/k/v and gate/up, a separate output head unless the spec says
    otherwise (the real ones have one)."""
    from dataclasses import replace

    spec = replace(spec or TinyLlamaSpec(tied_embeddings=False), fused=True)
    return write_tiny_llama(path, spec, arch="phi3")


@dataclass
class TinyGemma3Spec:
    # 7 layers: local 0-4, global 5 (every 6th), local 6. head_dim 256 as in every Gemma 3 but the
    # 27B, so transformers' default query_pre_attn_scalar (256) and llama.cpp's 1/sqrt(head_dim) agree.
    n_layers: int = 7
    dim: int = 64
    n_heads: int = 2
    n_kv_heads: int = 1
    head_dim: int = 256
    ffn_dim: int = 128
    context_length: int = 256
    sliding_window: int = 8
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    weight_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32
    seed: int = 0
    # Gemma 2 (write_tiny_gemma2): no q/k head norms; its score and logit caps, small enough here to bite
    # (a tiny random model's scores and logits are well under the released models' 50 and 30).
    arch: str = "gemma3"
    attn_softcap: float = 0.5
    final_softcap: float = 1.0


def write_tiny_gemma2(path: Path | str, tokenizer: dict, spec: TinyGemma3Spec | None = None) -> Path:
    """A tiny random Gemma 2 (layers alternate local and global, the first local)."""
    from dataclasses import replace

    return write_tiny_gemma3(path, tokenizer, replace(spec or TinyGemma3Spec(n_layers=4), arch="gemma2"))


def write_tiny_gemma3(path: Path | str, tokenizer: dict, spec: TinyGemma3Spec | None = None) -> Path:
    """A tiny random Gemma 3 as llama.cpp's converter writes one: norm weights stored with Gemma's
    +1 already added, Q/K rows in half-split rotary order, tied embeddings. `tokenizer` holds the
    `tokenizer.ggml.*` metadata (its token list sets the vocabulary size)."""
    spec = spec or TinyGemma3Spec()
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    gemma2 = spec.arch == "gemma2"
    w = gguf.GGUFWriter(str(path), spec.arch)
    w.add_name(f"tiny-random-{spec.arch}")
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.dim)
    w.add_feed_forward_length(spec.ffn_dim)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_sliding_window(spec.sliding_window)
    if gemma2:
        w.add_float32(f"{spec.arch}.attn_logit_softcapping", spec.attn_softcap)
        w.add_float32(f"{spec.arch}.final_logit_softcapping", spec.final_softcap)
    w.add_file_type(int(spec.weight_type))
    add_metadata(w, tokenizer)

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, 0.08, size=(rows, cols))

    def norm(n: int) -> np.ndarray:
        return 1.0 + rng.normal(0, 0.1, n)

    f32, wt, hd = gguf.GGMLQuantizationType.F32, spec.weight_type, spec.head_dim
    _add(w, "token_embd.weight", mat(vocab, spec.dim), wt)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            _add(w, p + name + ".weight", norm(spec.dim), f32)
        if not gemma2:
            _add(w, p + "attn_q_norm.weight", norm(hd), f32)
            _add(w, p + "attn_k_norm.weight", norm(hd), f32)
        _add(w, p + "attn_q.weight", mat(spec.n_heads * hd, spec.dim), wt)
        _add(w, p + "attn_k.weight", mat(spec.n_kv_heads * hd, spec.dim), wt)
        _add(w, p + "attn_v.weight", mat(spec.n_kv_heads * hd, spec.dim), wt)
        _add(w, p + "attn_output.weight", mat(spec.dim, spec.n_heads * hd), wt)
        _add(w, p + "ffn_gate.weight", mat(spec.ffn_dim, spec.dim), wt)
        _add(w, p + "ffn_up.weight", mat(spec.ffn_dim, spec.dim), wt)
        _add(w, p + "ffn_down.weight", mat(spec.dim, spec.ffn_dim), wt)
    _add(w, "output_norm.weight", norm(spec.dim), f32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
