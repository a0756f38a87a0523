"""Text <-> token ids for a GGUF model, built from the vocabulary the GGUF carries in its metadata.

A GGUF has no tokenizer.json, so we rebuild the `tokenizers` pipeline the same way transformers does
for a GGUF (integrations/gguf/gguf_tokenizer_mapping.py): same vocabulary spelling, merges,
pre-tokenizer split, decoder and added tokens. That makes ids and decoded text identical to
transformers' without importing it at run time. Byte-level BPE vocabularies are built here, Gemma's
SentencePiece ones in sentencepiece.py.
"""
from __future__ import annotations

import copy

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from tokenmill.gguf import open_gguf
from tokenmill.tokenizer import sentencepiece
from tokenmill.tokenizer.sentencepiece_llama import build_llama
from tokenmill.tokenizer.chat_template import ChatTemplate, ChatTemplateError, TokenizerError

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL = 3
_USER_DEFINED = 4


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the alphabet byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


# Texts longer than this are encoded without holding the GIL (encode_batch of one; same ids).
GIL_FREE_CHARS = 2048

_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_ALPHABET = frozenset(_CHAR_TO_BYTE)

# Split regexes for `tokenizer.ggml.pre`, copied from transformers' GGUF mapping (which takes them from
# the models' tokenizer.json files). None means the GPT-2 regex built into the ByteLevel pre-tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Only `pre` values we know the right split for are accepted: transformers silently falls back to the
# GPT-2 regex for unknown ones, which tokenizes some text differently from how the model was trained.
# Note: llama.cpp also splits digits one by one for the starcoder family (smollm, starcoder, refact,
# codeshell); transformers does not, and we follow transformers. For SmolLM2 the results differ only
# where a run of 2+ whitespace characters directly precedes a digit.
_PRE_SPLITS: dict[str, str | None] = {
    "gpt-2": None,
    "phi-2": None,
    "smollm": None,
    "starcoder": None,
    "refact": None,
    "codeshell": None,
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}

# Control tokens that end a turn even when the GGUF does not name them EOS/EOT (llama.cpp's list).
_END_OF_TURN_NAMES = frozenset({
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
    "<｜end▁of▁sentence｜>", "<|end▁of▁sentence|>", "<end_of_utterance>", "<|return|>", "<|call|>",
})


def _vocab_key(token: str, kind: int) -> str:
    """How a GGUF token is spelled in the BPE vocabulary. Some converters store tokens as raw text
    instead of in the byte alphabet; BPE never produces those, so they are respelled, except control and
    user-defined ones, which are matched whole in the text by what they say (see _build_byte_level)."""
    if kind in (_CONTROL, _USER_DEFINED) or set(token) <= _ALPHABET:
        return token
    return "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))


def _shown(value: object) -> str:
    """A metadata value in a message: its repr, cut short (a file may hold a name of megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def unsupported_tokenizer(model: object, pre: object, architecture: object) -> str | None:
    """Why the tokenizer a GGUF names (tokenizer.ggml.model and .pre, for general.architecture) cannot
    be built here, or None. gguf/validate.py asks it of a pushed file before anything is loaded."""
    if model == "gpt2":
        key = pre or "gpt-2"  # files older than the `pre` key were all GPT-2 style
        if not isinstance(key, str) or key not in _PRE_SPLITS:
            return (f"unsupported pre-tokenizer tokenizer.ggml.pre={_shown(pre)}; "
                    f"supported: {', '.join(sorted(_PRE_SPLITS))}")
        return None
    if model == "llama":
        # Gemma's pipeline for Gemma files, Llama's (a prefix space) for the rest: Llama 2, Mistral, ...
        return None
    return (f"unsupported tokenizer.ggml.model={_shown(model)}; supported: byte-level BPE ('gpt2') and "
            "SentencePiece ('llama')")


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    problem = unsupported_tokenizer("gpt2", pre, None)
    if problem:
        raise TokenizerError(problem)
    split = _PRE_SPLITS[pre or "gpt-2"]
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _token_id(metadata: Mapping[str, Any], key: str, n_tokens: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}")
    if isinstance(value, int) and 0 <= value < n_tokens:
        return value
    return None


def _build_byte_level(metadata: Mapping[str, Any], tokens: list[str]) -> _Backend:
    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise TokenizerError("byte-level BPE tokenizer has no tokenizer.ggml.merges")
    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    kinds = types + [1] * (len(tokens) - len(types))
    keys = [_vocab_key(token, kind) for token, kind in zip(tokens, kinds)]
    backend = _Backend(models.BPE(
        vocab={key: index for index, key in enumerate(keys)}, merges=[tuple(m.split(" ")) for m in merges],
        dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
    ))
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()

    # Added tokens are matched whole in the text before BPE. Order matters for overlapping matches,
    # so they are added in transformers' order: control, user-defined, then the named specials.
    # Deviation: transformers skips control/user-defined tokens written outside the byte alphabet
    # (e.g. DeepSeek's '<｜User｜>'), so they are cut into bytes, and it gives a raw-text BOS a new id
    # the model does not have. We keep their raw text in the vocabulary, so they match whole under their
    # own id, as in llama.cpp and the models' original tokenizer.json.
    control = [AddedToken(key, normalized=False, special=True) for key, kind in zip(keys, kinds) if kind == _CONTROL]
    if control:
        backend.add_special_tokens(control)
    user_defined = [AddedToken(key, normalized=False, special=False)
                    for key, kind in zip(keys, kinds) if kind == _USER_DEFINED]
    if user_defined:
        backend.add_tokens(user_defined)
    added = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    for name in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        index = _token_id(metadata, name, len(tokens))
        if index is not None and keys[index] not in added:
            backend.add_special_tokens([AddedToken(keys[index], normalized=False, special=True)])
            added.add(keys[index])
    return backend


def _build_sentencepiece(metadata: Mapping[str, Any],
                         tokens: list[str]) -> tuple[_Backend, list[bytes], frozenset[int]]:
    problem = unsupported_tokenizer("llama", None, metadata.get("general.architecture"))
    if problem:
        raise TokenizerError(problem)
    named = {key: _token_id(metadata, key, len(tokens))
             for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")}
    named = {k: v for k, v in named.items() if v is not None}
    if metadata.get("general.architecture") in sentencepiece.GEMMA_ARCHITECTURES:
        return sentencepiece.build_gemma(metadata, tokens, named)
    return build_llama(metadata, tokens, named)


def _decoded_bytes(backend: _Backend, vocab_size: int) -> list[bytes]:
    """What decode() turns each id into: the ByteLevel decoder maps alphabet characters back to bytes,
    and keeps a token's UTF-8 text when any character is outside the alphabet."""
    table = []
    for index in range(vocab_size):
        text = backend.id_to_token(index)
        if text is None:  # lost to a duplicate spelling; decode() drops it too
            table.append(b"")
        elif set(text) <= _ALPHABET:
            table.append(bytes(_CHAR_TO_BYTE[c] for c in text))
        else:
            table.append(text.encode("utf-8"))
    return table


# Gemma GGUFs converted without the model's tokenizer_config.json carry no chat template, so Gemma's
# own format is built in, rewritten after the template of Google's Gemma 3 instruct models: turns
# alternate user/model ("assistant" is written "model"), contents are trimmed, and a first system
# message goes at the start of the first user turn, followed by a blank line. Gemma 1 and 2's own
# templates write turns the same way but reject a system message; this one folds it in instead.
_GEMMA_CHAT_TEMPLATE = """{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system = messages[0]['content'] -%}
  {%- set first_prefix = (system if system is string else system[0]['text']) + '\n\n' -%}
  {%- set turns = messages[1:] -%}
{%- else -%}
  {%- set first_prefix = '' -%}
  {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
  {%- endif -%}
  {{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' -}}
  {{- first_prefix if loop.first else '' -}}
  {%- if message['content'] is string -%}
    {{- message['content'] | trim -}}
  {%- elif message['content'] is iterable -%}
    {%- for part in message['content'] -%}
      {%- if part['type'] == 'image' -%}
        {{- '<start_of_image>' -}}
      {%- elif part['type'] == 'text' -%}
        {{- part['text'] | trim -}}
      {%- endif -%}
    {%- endfor -%}
  {%- else -%}
    {{- raise_exception('Invalid content type') -}}
  {%- endif -%}
  {{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""

# Used only when the file has none, keyed by general.architecture.
_BUILTIN_CHAT_TEMPLATES = dict.fromkeys(sentencepiece.GEMMA_ARCHITECTURES, _GEMMA_CHAT_TEMPLATE)


def chat_template_source(metadata: Mapping[str, Any]) -> str | None:
    """The chat template a model is served with: its file's, else the built-in one for its architecture."""
    source = metadata.get("tokenizer.chat_template")
    if isinstance(source, str) and source:
        return source
    return _BUILTIN_CHAT_TEMPLATES.get(metadata.get("general.architecture"))


def _stop_ids(metadata: Mapping[str, Any], tokens: list[str]) -> frozenset[int]:
    named = (_token_id(metadata, key, len(tokens)) for key in ("eos_token_id", "eot_token_id", "eom_token_id"))
    stops = {index for index in named if index is not None}
    types = metadata.get("tokenizer.ggml.token_type") or []
    stops |= {i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == _CONTROL and t in _END_OF_TURN_NAMES}
    return frozenset(stops)


class Tokenizer:
    """A GGUF model's tokenizer: encode/decode with transformers' exact results, plus its chat template."""

    def __init__(self, backend: _Backend, tokens: list[str], metadata: Mapping[str, Any], *,
                 token_bytes: list[bytes], byte_fallback_ids: frozenset[int] = frozenset()):
        self._backend = backend
        self.vocab_size = len(tokens)
        self.bos_id = _token_id(metadata, "bos_token_id", self.vocab_size)
        self.eos_id = _token_id(metadata, "eos_token_id", self.vocab_size)
        self.stop_ids = _stop_ids(metadata, tokens)
        # A SentencePiece file that does not say gets BOS, as llama.cpp and transformers give it.
        sentencepiece_file = metadata.get("tokenizer.ggml.model") == "llama"
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", sentencepiece_file))
        self._add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))  # transformers honours it too
        self._special_ids = frozenset(
            i for i, added in backend.get_added_tokens_decoder().items() if added.special and i < self.vocab_size
        )
        self._bytes = token_bytes
        self._byte_fallback_ids = byte_fallback_ids

        self.chat_template: ChatTemplate | None = None
        # A template that does not compile must not make the model unloadable (raw completion still
        # works), so its error is kept and raised when a chat prompt is asked for.
        self._template_error: ChatTemplateError | None = None
        source = chat_template_source(metadata)
        if source is not None:

            def named(key: str) -> str | None:
                index = _token_id(metadata, key, self.vocab_size)
                return tokens[index] if index is not None else None

            try:
                self.chat_template = ChatTemplate(
                    source, bos_token=named("bos_token_id"), eos_token=named("eos_token_id"),
                    unk_token=named("unknown_token_id"), pad_token=named("padding_token_id"),
                )
            except ChatTemplateError as exc:
                self._template_error = exc

    def with_chat_template(self, source: str) -> Tokenizer:
        """The same tokenizer rendering chats with `source` (a derived model's TEMPLATE); the special
        tokens the template may name stay the model's. Raises ChatTemplateError if it does not compile."""
        special = getattr(self.chat_template, "special_tokens", {}) if self.chat_template else {}
        other = copy.copy(self)
        other.chat_template = ChatTemplate(source, **{"bos_token": None, "eos_token": None, **special})
        other._template_error = None
        return other

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF file describes; metadata it cannot use is a TokenizerError."""
        try:
            return cls._from_metadata(metadata)
        except TokenizerError:
            raise
        except Exception as exc:  # noqa: BLE001 - `tokenizers` raises bare Exceptions; wrong types raise TypeError
            raise TokenizerError(f"the tokenizer in the model file is malformed: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def _from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("the model file has no tokenizer.ggml.tokens vocabulary")
        tokens = list(tokens)
        if model == "gpt2":
            backend = _build_byte_level(metadata, tokens)
            return cls(backend, tokens, metadata, token_bytes=_decoded_bytes(backend, len(tokens)))
        if model == "llama":
            backend, table, byte_ids = _build_sentencepiece(metadata, tokens)
            return cls(backend, tokens, metadata, token_bytes=table, byte_fallback_ids=byte_ids)
        raise TokenizerError(unsupported_tokenizer(model, None, None))

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        return cls.from_gguf_metadata(open_gguf(path).metadata)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in the text are parsed as themselves."""
        if len(text) > GIL_FREE_CHARS:
            # `tokenizers` holds the GIL through encode() but releases it in encode_batch(): a long
            # text tokenized on a worker thread then leaves the server's event loop running.
            ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self._add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text for `ids`; bytes that are not valid UTF-8 become U+FFFD, unknown ids are dropped."""
        try:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as exc:
            raise TokenizerError(f"cannot decode ids: {exc}") from exc

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (possibly part of a UTF-8 character)."""
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return self._bytes[token_id]

    def is_byte_fallback(self, token_id: int) -> bool:
        """Whether this is a SentencePiece `<0xXX>` token. decode() reads a run of them as one: their
        bytes as text when they are valid UTF-8, else one U+FFFD per byte (the ByteFallback decoder)."""
        return token_id in self._byte_fallback_ids

    def is_special(self, token_id: int) -> bool:
        """Whether `decode(..., skip_special_tokens=True)` drops this token."""
        return token_id in self._special_ids

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        if self._template_error is not None:
            raise self._template_error
        if self.chat_template is None:
            raise TokenizerError("the model has no chat template (tokenizer.chat_template is missing)")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)
