"""Llama-style SentencePiece vocabularies (`tokenizer.ggml.model == "llama"` outside Gemma: Llama 2,
Mistral 7B up to v0.3, TinyLlama, CodeLlama, ...) as the `tokenizers` pipeline transformers builds for
such a GGUF (integrations/gguf's sentencepiece_tokenizer and models/llama/tokenization_llama.py), so ids
and decoded text match it:

- BPE with byte fallback; merges from the file, or recovered from the vocabulary by the tokens' scores
  (as transformers' generate_merges: every cut of a token into two tokens, ranked by the token's score).
- A prefix space: Metaspace turns spaces into "▁" and puts one before the text's start.
- Decoder: "▁" back to a space, `<0xXX>` runs back to bytes, joined, and the one leading space the
  prefix made stripped again.
- Control tokens special, user-defined ones added whole, as for Gemma (sentencepiece.py).

The file's tokenizer.ggml.add_space_prefix is what llama.cpp reads; transformers always prepends, so a
file that says False is refused rather than tokenized unlike either."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import Tokenizer as _Backend
from tokenizers import decoders, models, pre_tokenizers

from tokenmill.tokenizer.chat_template import TokenizerError
from tokenmill.tokenizer.sentencepiece import MAX_SLICING_COST, add_vocabulary_tokens, decoded_bytes

_SPACE = "\u2581"


def score_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """transformers' generate_merges(vocab, vocab_scores): for each distinct token (first listing order),
    its cuts into two vocabulary tokens ordered by the sides' ids; all of them then ranked by the
    token's score, best first, ties by the sides' lengths, longer first (a stable sort)."""
    if sum(len(t) ** 2 for t in tokens) > MAX_SLICING_COST:
        raise TokenizerError(f"the vocabulary holds tokens too long to find its merges "
                             f"(longest: {max(map(len, tokens))} characters)")
    vocab = {token: index for index, token in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    cuts = []
    for token, score in score_of.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        cuts += [(left, right, score) for left, right in pairs]
    cuts.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in cuts]


def build_llama(metadata: Mapping[str, Any], tokens: list[str],
                named_ids: Mapping[str, int]) -> tuple[_Backend, list[bytes], frozenset[int]]:
    """The pipeline, each id's bytes and the byte-fallback ids (as sentencepiece.build_gemma)."""
    if metadata.get("tokenizer.ggml.add_space_prefix") is False:
        raise TokenizerError("a Llama-style SentencePiece vocabulary with tokenizer.ggml.add_space_prefix=False "
                             "is not supported")
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in (None, "default"):
        raise TokenizerError(f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r} for a SentencePiece vocabulary")
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges if isinstance(m, str) and " " in m]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise TokenizerError("a SentencePiece vocabulary needs tokenizer.ggml.scores (a score a token) or merges")
        pairs = score_merges(tokens, [float(s) for s in scores])
    backend = _Backend(models.BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=pairs,
                                  dropout=None, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    add_vocabulary_tokens(backend, metadata, tokens, tokens, named_ids)
    return (backend, *decoded_bytes(tokens))
