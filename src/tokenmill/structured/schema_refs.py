"""Local `$ref`s of a JSON schema: where one points in its document, and moving a schema into
another's `$defs` without breaking them.

Only what a schema's own document holds is resolved ("#", "#/json/pointer", "#anchor"); a ref to
another document (a URL, a nested `$id`) is left to the grammar compiler, which says whether it
knows it."""
from __future__ import annotations

from typing import Any
from urllib.parse import unquote

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas: the places a
# `$ref` can sit. `const`, `enum`, `default` and `examples` hold plain values, never schemas.
SCHEMA_KEYWORDS = frozenset({"additionalProperties", "items", "additionalItems", "contains", "not", "if", "then",
                             "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties"})
SCHEMA_LIST_KEYWORDS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
SCHEMA_MAP_KEYWORDS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                                 "dependencies"})

_NOT_FOUND = object()


def subschemas(schema: Any) -> list[Any]:
    """The schemas directly inside `schema` (its properties, items, branches, definitions...)."""
    if not isinstance(schema, dict):
        return []
    out: list[Any] = []
    for key, value in schema.items():
        if key in SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            out += [v for v in value.values() if isinstance(v, (dict, bool))]  # "dependencies" also holds lists
        elif key in SCHEMA_LIST_KEYWORDS and isinstance(value, list):
            out += value
        elif key in SCHEMA_KEYWORDS and isinstance(value, (dict, bool)):
            out.append(value)
    return out


def has_nested_id(schema: Any) -> bool:
    """Whether a schema below the root declares its own `$id`, which changes what "#" means under it."""
    stack = subschemas(schema)
    while stack:
        s = stack.pop()
        if isinstance(s, dict):
            if "$id" in s or "id" in s and isinstance(s["id"], str) and not s["id"].startswith("#"):
                return True
            stack += subschemas(s)
    return False


def resolve_ref(root: Any, ref: str) -> Any:
    """The value `ref` points at in `root`'s document, or None if it is not a local ref there."""
    if not ref.startswith("#"):
        return None
    fragment = unquote(ref[1:])
    if fragment == "":
        return root
    if not fragment.startswith("/"):
        return _anchor(root, fragment)
    target: Any = root
    for token in fragment[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict):
            target = target.get(token, _NOT_FOUND)
        elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
            target = target[int(token)]
        else:
            return None
        if target is _NOT_FOUND:
            return None
    return target


def _anchor(root: Any, name: str) -> Any:
    """The schema with `$anchor` `name` (or a draft-07 `$id` of "#name")."""
    stack = [root]
    while stack:
        s = stack.pop()
        if isinstance(s, dict):
            if s.get("$anchor") == name or s.get("$id") == "#" + name:
                return s
            stack += subschemas(s)
    return None


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of `schema` to be placed at `base` (a "#/..." pointer) of a larger document: its
    local pointer refs ("#", "#/$defs/node") are rewritten to point where they did before."""
    if isinstance(schema, list):
        return [rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            out[key] = {k: rebase_refs(v, base) for k, v in value.items()}
        elif key in SCHEMA_LIST_KEYWORDS | SCHEMA_KEYWORDS:
            out[key] = rebase_refs(value, base)
        else:
            out[key] = value
    return out
