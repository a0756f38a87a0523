"""Decoding JSON a client sent: the request body and the JSON text some fields carry (a schema given
as a string, a past tool call's arguments). Every such text goes through `decode_json`, so what would
break the server later is a 400 here instead of a 500 there:

- nesting deeper than MAX_JSON_DEPTH: Python's decoder gives up near 1000 levels with a
  RecursionError, and code that walks a value recursively (schema compilers, templates, json.dumps)
  fails well before that on a value that did parse;
- an integer of more digits than Python converts (sys.get_int_max_str_digits(), 4300 by default);
- a string holding a lone UTF-16 surrogate (`"\\ud800"`, or its bytes in the body): JSON allows the
  escape, but it is no character, and the tokenizer, the regex compiler and the response encoder
  all reject it."""
from __future__ import annotations

import json
import sys
from typing import Any

from tokenmill.server.errors import bad_request

# Deep enough for any schema or message list a client means (a schema 40 objects deep is ~80).
MAX_JSON_DEPTH = 128
_SCALARS = frozenset({int, float, bool, type(None)})


def decode_json(text: str | bytes, label: str | None = None) -> Any:
    """The value JSON `text` holds, or a 400 naming `label` (None: the request body)."""
    try:
        return loads_checked(text, label)
    except json.JSONDecodeError as exc:
        raise bad_request(_where(label, str(exc)), label) from None


def loads_checked(text: str | bytes, label: str | None = None) -> Any:
    """`decode_json` for callers that tolerate text that is not JSON: a syntax error stays a
    json.JSONDecodeError; nesting, a number or a string the server cannot hold is still a 400."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise bad_request(_where(label, f"nested more than {MAX_JSON_DEPTH} levels deep"), label) from None
    except json.JSONDecodeError:
        raise
    except UnicodeDecodeError as exc:
        raise bad_request(_where(label, f"not UTF-8 text ({exc.reason} at byte {exc.start})"), label) from None
    except ValueError:  # the only other one json.loads raises: an integer too long to convert
        digits = sys.get_int_max_str_digits()
        raise bad_request(_where(label, f"a number has more than {digits} digits"), label) from None
    check_value(value, label)
    return value


def check_value(value: Any, label: str | None = None) -> None:
    """A 400 if decoded JSON `value` nests too deeply or holds a string that is not valid Unicode.
    Iterative, so a deep value cannot exhaust the stack while it is checked."""
    # Each entry: (value, depth, link) where link = (parent link, key) spells its place for the message.
    pending: list[tuple[Any, int, tuple | None]] = [(value, 1, None)]
    while pending:
        item, depth, link = pending.pop()
        if isinstance(item, str):
            _check_text(item, label, link)
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad_request(_where(label, f"nested more than {MAX_JSON_DEPTH} levels deep"), label)
        if isinstance(item, dict):
            for key, v in item.items():
                _check_text(key, label, link, is_key=True)
                if isinstance(v, (str, dict, list)):
                    pending.append((v, depth + 1, (link, key)))
        elif isinstance(item, list) and not _SCALARS.issuperset(map(type, item)):  # token ids: nothing to walk
            pending.extend((v, depth + 1, (link, i)) for i, v in enumerate(item) if isinstance(v, (str, dict, list)))


def _check_text(text: str, label: str | None, link: tuple | None, *, is_key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        place = _place(label, link)
        what = f"a key in {place}" if is_key else place
        bad = text[exc.start].encode("utf-8", "backslashreplace").decode("ascii")
        raise bad_request(f"{what} is not valid Unicode: it holds a lone UTF-16 surrogate ({bad}), "
                          "half of a pair with no other half", place) from None


def _place(label: str | None, link: tuple | None) -> str:
    """`messages[0].content` for the link to that string, under `label` if the JSON was a field's."""
    parts = []
    while link is not None:
        link, key = link
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    path = "".join(reversed(parts)).lstrip(".")
    if label is None:
        return path or "the request body"
    return f"{label}{'.' if path and not path.startswith('[') else ''}{path}"


def _where(label: str | None, problem: str) -> str:
    return f"invalid JSON body: {problem}" if label is None else f"{label} is not valid JSON: {problem}"
