"""The grammar of a model name, Ollama's: `[host/][namespace/]model[:tag]`, each part of ASCII
letters, digits, `_`, `-` and `.` that starts with a letter, digit or `_` (a namespace has no `.`, a
host may carry a `:port`). Every name a request gives is checked against it before the store is
touched, so a name is never a path (no `/` in front, no `..`, no `.gguf` file name, no `\\`), never
longer than a file name may be, and never a string the store's files or JSON cannot hold (lone
surrogates, control characters, NUL).

The error says what is wrong without echoing the name: a hostile name is the client's own anyway,
and an echo is one more place for it to break a response."""
from __future__ import annotations

import re
from dataclasses import dataclass

from tokenmill.store.catalog import StoreError

MAX_PART = 80      # namespace, model and tag, as Ollama's isValidLen
MAX_HOST = 350
# The whole name, so that its record in the store (quoted, plus ".json") stays under the 255 bytes
# a file name may have on every common file system.
MAX_NAME = 200

_PART_CHARS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_HOST_CHARS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-:]*")
# A blob digest as Ollama writes one (`sha256:<hex>`, `sha256-<hex>` on disk, `@` before it in a
# Modelfile the CLI rewrote); `sha256:<hex>` is also a well-formed name (model `sha256`, tag the hex).
_DIGEST = re.compile(r"@?sha256[:\-][0-9a-fA-F]{64}")

GRAMMAR = "[host/][namespace/]model[:tag], letters, digits, '_', '-' and '.'"


class InvalidModelName(StoreError):
    """A name that breaks the grammar; its message never contains the name."""


@dataclass(frozen=True)
class ModelName:
    model: str
    tag: str = ""
    namespace: str = ""
    host: str = ""

    def __str__(self) -> str:
        prefix = "".join(f"{p}/" for p in (self.host, self.namespace) if p)
        return prefix + self.model + (f":{self.tag}" if self.tag else "")


def _invalid(why: str) -> InvalidModelName:
    return InvalidModelName(f"invalid model name: {why} (a model name is {GRAMMAR})")


def _check_part(kind: str, part: str, limit: int, chars: re.Pattern) -> None:
    if not part:
        raise _invalid(f"its {kind} is empty")
    if len(part) > limit:
        raise _invalid(f"its {kind} is {len(part)} characters long; at most {limit}")
    if not chars.fullmatch(part):
        first = not chars.fullmatch(part[0])
        raise _invalid(f"its {kind} starts with a character that is not allowed" if first
                       else f"its {kind} has a character that is not allowed")
    if kind == "namespace" and "." in part:
        raise _invalid("its namespace has a '.'")


def parse_model_name(text: object) -> ModelName:
    """The parts of `text`, or InvalidModelName. Case is kept (the store compares names folded)."""
    if not isinstance(text, str):
        raise _invalid(f"it is {type(text).__name__}, not a string")
    if not text:
        raise _invalid("it is empty")
    if len(text) > MAX_NAME:
        raise _invalid(f"it is {len(text)} characters long; at most {MAX_NAME}")
    if not text.isascii() or not text.isprintable():
        raise _invalid("it has a character that is not allowed (only printable ASCII is)")
    if ".." in text:
        raise _invalid("it has '..'")
    if text.startswith(("/", "~")) or "\\" in text or text.lower().endswith(".gguf"):
        raise _invalid("it looks like a file path; requests name models, never files")
    rest, tag = text, ""
    colon = text.rfind(":")
    if colon >= 0 and "/" not in text[colon + 1:]:  # else the colon is a host's port
        rest, tag = text[:colon], text[colon + 1:]
        _check_part("tag", tag, MAX_PART, _PART_CHARS)
    segments = rest.split("/")
    if len(segments) > 3:
        raise _invalid("it has more than two '/'")
    host = segments[0] if len(segments) == 3 else ""
    namespace = segments[-2] if len(segments) >= 2 else ""
    model = segments[-1]
    if len(segments) == 3:
        _check_part("host", host, MAX_HOST, _HOST_CHARS)
    if len(segments) >= 2:
        _check_part("namespace", namespace, MAX_PART, _PART_CHARS)
    _check_part("model part", model, MAX_PART, _PART_CHARS)
    return ModelName(model, tag, namespace, host)


def check_model_name(text: object) -> str:
    """`text` if it is a well-formed model name, else InvalidModelName."""
    parse_model_name(text)
    return text  # type: ignore[return-value]


def is_blob_digest(text: str) -> bool:
    return bool(_DIGEST.fullmatch(text))


def check_model_reference(text: object) -> str:
    """What a model may be made FROM: a model name, or the digest of a blob the server holds."""
    if isinstance(text, str) and is_blob_digest(text):
        return text
    return check_model_name(text)
