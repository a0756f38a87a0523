"""SentencePiece-style vocabularies (`tokenizer.ggml.model == "llama"`) as a `tokenizers` BPE pipeline.

We rebuild exactly what transformers builds for a Gemma GGUF (integrations/gguf/gguf_tokenizer_mapping.py,
`gemma_tokenizer`, and models/gemma/tokenization_gemma.py), so ids and decoded text match it:

- BPE with byte fallback: a character missing from the vocabulary becomes its UTF-8 bytes, spelled
  `<0xXX>`; `<unk>` is used only when even those are missing.
- Normalizer: every space becomes "▁". No space is prepended (Gemma files say add_space_prefix=False).
- No effective pre-tokenizer: it splits on " ", which the normalizer has already removed, so BPE
  sees each stretch of text between added tokens whole.
- Decoder: "▁" back to a space, runs of `<0xXX>` back to bytes, then everything joined.
- Whitespace-only tokens the file spells with real spaces are respelled with "▁", as BPE sees them.
- The file has no merges: they are recovered from the vocabulary, ranked by the order the tokens
  appear in the file (Gemma's scores do not follow its merge order).

Other SentencePiece models (Llama 2, Mistral, Phi-3...) get a different pipeline under transformers
(a prefix space from Metaspace, a decoder that strips it again), which is not built here.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from tokenmill.tokenizer.chat_template import TokenizerError

# Architectures whose SentencePiece vocabulary transformers builds with its Gemma pipeline.
GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL = 3
_USER_DEFINED = 4

_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# What the ByteFallback decoder reads as one raw byte: 6 UTF-8 bytes, "<0x", a number Rust's
# u8::from_str_radix(_, 16) accepts (which allows a leading "+"), ">".
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2}|\+[0-9A-Fa-f])>")


def gemma_spelling(tokens: Sequence[str]) -> list[str]:
    """The vocabulary as BPE sees it: Gemma files store the tokens of 2+ spaces as real spaces, but
    the normalizer turns the text's spaces into "▁" before BPE, so those tokens are respelled (every
    character of a whitespace-only token that holds a space, as transformers does)."""
    return [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def _merges_by_slicing(spelled: list[str]) -> list[tuple[str, str]]:
    """Every way to cut a token into two vocabulary tokens, best merge first: tokens in file order,
    each one's cuts with the longest left part first. A token listed twice ranks where it is last
    listed, as in transformers' `generate_merges`."""
    vocab = {token: index for index, token in enumerate(spelled)}
    return [
        (token[:cut], token[cut:])
        for index, token in enumerate(spelled) if vocab[token] == index
        for cut in range(len(token) - 1, 0, -1)
        if token[:cut] in vocab and token[cut:] in vocab
    ]


def _merges_by_hashing(spelled: list[str]) -> list[tuple[str, str]] | None:
    """`_merges_by_slicing` vectorized: slicing Gemma's 262k tokens 1.2M ways in Python takes over a
    second, and the server builds the tokenizer at start. Each side of each cut is looked up among the
    tokens by a hash of its text, and every hit is then checked character by character. None when two
    tokens hash alike (duplicate tokens do), as the lookup could then miss one: the caller slices."""
    lengths = np.fromiter(map(len, spelled), dtype=np.int64, count=len(spelled))
    starts = np.cumsum(lengths) - lengths
    chars = np.frombuffer("".join(spelled).encode("utf-32-le"), dtype=np.uint32)
    hash_of = _SliceHasher(chars)
    token_hashes = hash_of(starts, starts + lengths)
    order = np.argsort(token_hashes)
    sorted_hashes = token_hashes[order]
    if (sorted_hashes[1:] == sorted_hashes[:-1]).any():
        return None

    def find(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The id of the token whose hash and length this slice has, or -1."""
        hashes = hash_of(lo, hi)
        at = np.minimum(np.searchsorted(sorted_hashes, hashes), len(order) - 1)
        ids = order[at]
        return np.where((sorted_hashes[at] == hashes) & (lengths[ids] == hi - lo), ids, -1)

    # Every cut, in merge-rank order: token by token, longest left side first.
    n_cuts = np.maximum(lengths - 1, 0)
    token = np.repeat(np.arange(len(spelled)), n_cuts)
    left_len = np.repeat(lengths - 1 + np.cumsum(n_cuts) - n_cuts, n_cuts) - np.arange(len(token))
    cut = starts[token] + left_len
    left = find(starts[token], cut)
    token, cut, left = token[left >= 0], cut[left >= 0], left[left >= 0]
    right = find(cut, starts[token] + lengths[token])
    token, left, right = token[right >= 0], left[right >= 0], right[right >= 0]

    # A hash match is not proof: keep the cuts whose sides really spell the token.
    exact = (_same_text(chars, starts[token], starts[left], lengths[left])
             & _same_text(chars, starts[token] + lengths[left], starts[right], lengths[right]))
    sides = map(spelled.__getitem__, left[exact].tolist()), map(spelled.__getitem__, right[exact].tolist())
    return list(zip(*sides))


class _SliceHasher:
    """A polynomial hash (mod 2^64) of any slice of `chars`, in O(1) per slice after an O(n) setup,
    equal for equal text wherever it sits."""

    _BASE = 0x100000001B3  # odd, so it has an inverse mod 2^64

    def __init__(self, chars: np.ndarray):
        base = np.uint64(self._BASE)
        inverse = np.uint64(pow(self._BASE, -1, 2**64))
        with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2^64, which is what we want
            self._powers = np.cumprod(np.full(len(chars) + 1, base, np.uint64)) * inverse  # base**i
            inverse_powers = np.cumprod(np.full(len(chars), inverse, np.uint64)) * base  # base**-i
            # +1 so that a U+0000 still counts.
            weighted = (chars.astype(np.uint64) + np.uint64(1)) * inverse_powers
            self._prefix = np.concatenate([np.zeros(1, np.uint64), np.cumsum(weighted, dtype=np.uint64)])

    def __call__(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        # sum((chars[i] + 1) * base**(hi - 1 - i) for i in range(lo, hi)), as base**(hi - 1) times
        # the difference of two prefix sums weighted by base**-i.
        with np.errstate(over="ignore"):
            return (self._prefix[hi] - self._prefix[lo]) * self._powers[np.maximum(hi - 1, 0)]


def _same_text(chars: np.ndarray, a: np.ndarray, b: np.ndarray, length: np.ndarray) -> np.ndarray:
    """For each row, whether chars[a:a+length] == chars[b:b+length]."""
    row = np.repeat(np.arange(len(a)), length)
    offset = np.arange(len(row)) - np.repeat(np.cumsum(length) - length, length)
    differs = chars[a[row] + offset] != chars[b[row] + offset]
    return np.bincount(row[differs], minlength=len(a)) == 0


# Slicing copies both sides of every cut: a token of n characters costs about n**2. Gemma's whole
# vocabulary costs ~10**7; a pushed file listing one token twice and another of a million characters
# held a model load for 2 minutes here (16 MB, the most a token may be, would take hours).
MAX_SLICING_COST = 10**9


def gemma_merges(spelled: list[str]) -> list[tuple[str, str]]:
    merges = _merges_by_hashing(spelled)
    if merges is not None:
        return merges
    if sum(len(token) ** 2 for token in spelled) > MAX_SLICING_COST:
        raise TokenizerError("the vocabulary lists a token twice and holds tokens too long to find its merges "
                             f"(longest: {max(map(len, spelled))} characters)")
    return _merges_by_slicing(spelled)


def build_gemma(metadata: Mapping[str, Any], tokens: list[str],
                named_ids: Mapping[str, int]) -> tuple[_Backend, list[bytes], frozenset[int]]:
    """The `tokenizers` pipeline transformers builds for a Gemma GGUF, with each id's bytes and the
    byte-fallback ids (see `decoded_bytes`). `named_ids` maps the file's keys for BOS, EOS, UNK and PAD
    ("bos_token_id"...) to valid ids; those are special tokens even when not marked control."""
    if metadata.get("tokenizer.ggml.add_space_prefix"):
        # transformers ignores the flag for Gemma and never prepends; llama.cpp would. A file asking
        # for it is not one we know how to tokenize the way the model was trained.
        raise TokenizerError("a Gemma vocabulary with tokenizer.ggml.add_space_prefix=True is not supported")
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in (None, "default"):
        raise TokenizerError(f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r} for a SentencePiece vocabulary")

    spelled = gemma_spelling(tokens)
    unk = named_ids.get("unknown_token_id")
    backend = _Backend(models.BPE(
        vocab={token: index for index, token in enumerate(spelled)}, merges=gemma_merges(spelled),
        dropout=None, unk_token=spelled[unk] if unk is not None else "<unk>", fuse_unk=True, byte_fallback=True,
    ))
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    # A no-op after the normalizer; kept so the pipeline is transformers' own, piece for piece.
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    add_vocabulary_tokens(backend, metadata, tokens, spelled, named_ids)
    return (backend, *decoded_bytes(spelled))


def add_vocabulary_tokens(backend: _Backend, metadata: Mapping[str, Any], tokens: list[str], spelled: list[str],
                named_ids: Mapping[str, int]) -> None:
    """Control tokens as special and user-defined ones as plain added tokens, both matched whole in the
    raw text before normalization (so "<end_of_turn>" and Gemma's "\\n\\n" or "<table>" tokens are
    never cut), then the named specials and Gemma's "<mask>".

    Only tokens whose file spelling is in the vocabulary are added. transformers skips the respelled
    whitespace tokens the same way when they are user-defined, as all of Gemma's are; a control one
    would get a new id past the vocabulary, so we skip it too."""
    vocab = set(spelled)
    kinds = list(metadata.get("tokenizer.ggml.token_type") or [])
    kinds += [1] * (len(tokens) - len(kinds))
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, kinds) if kind == _CONTROL and t in vocab]
    if control:
        backend.add_special_tokens(control)
    user_defined = [AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, kinds) if kind == _USER_DEFINED and t in vocab]
    if user_defined:
        backend.add_tokens(user_defined)
    # GemmaTokenizer's mask token defaults to "<mask>". When the vocabulary lacks it, transformers adds
    # it under a new id the model does not have; we do not.
    named = [spelled[i] for i in named_ids.values()] + (["<mask>"] if "<mask>" in vocab else [])
    added = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    for token in named:
        if token not in added:
            backend.add_special_tokens([AddedToken(token, normalized=False, special=True)])
            added.add(token)


def byte_fallback_value(token: str) -> int | None:
    """The raw byte a `<0xXX>` token stands for in decode(), or None for any other token."""
    match = _BYTE_TOKEN.fullmatch(token)
    return int(match.group(1), 16) if match else None


def decoded_bytes(spelled: list[str]) -> tuple[list[bytes], frozenset[int]]:
    """What decode() turns each id into ("▁" becomes a space, a `<0xXX>` token its raw byte), and the
    ids of the `<0xXX>` tokens, whose bytes decode() reads together (see IncrementalDetokenizer)."""
    table = [token.replace(_SPACE, " ").encode("utf-8") for token in spelled]
    byte_ids = []
    for index, token in enumerate(spelled):
        if token.startswith("<0x") and (value := byte_fallback_value(token)) is not None:
            table[index] = bytes((value,))
            byte_ids.append(index)
    if len(set(spelled)) < len(spelled):
        # The vocabulary keeps the last id of a token listed twice; decode() drops the others.
        last = {token: index for index, token in enumerate(spelled)}
        for index, token in enumerate(spelled):
            if last[token] != index:
                table[index] = b""
    return table, frozenset(i for i in byte_ids if table[i])
