"""Reading request bodies: JSON parsing and typed field access whose errors name the field, so a
client learns exactly which value to fix. Unknown fields are tolerated (clients send extras freely)
but logged once, so a silently ignored option is at least visible to the operator."""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

from starlette.requests import Request

from tokenmill.server.client_json import decode_json
from tokenmill.server.errors import bad_request, shown_value
from tokenmill.store.model_name import InvalidModelName, check_model_name, check_model_reference

log = logging.getLogger("tokenmill.server")

_MISSING = object()
_warned: set[tuple[str, str]] = set()


async def read_json(request: Request) -> dict:
    raw = await request.body()  # its size is held to the limit by access.BodyLimitMiddleware
    if not raw.strip():
        return {}
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def warn_once(where: str, what: str, message: str) -> None:
    if (where, what) not in _warned:
        _warned.add((where, what))
        log.warning("%s: %s", where, message)


def warn_unknown(body: dict, known: Iterable[str], where: str) -> list[str]:
    unknown = sorted(set(body) - set(known))
    for name in unknown:
        warn_once(where, name, f"ignoring unsupported field {name!r}")
    return unknown


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def get_str(body: dict, name: str, default: Any = None, *, required: bool = False, label: str | None = None) -> Any:
    label = label or name
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        if required:
            raise bad_request(f"{label} is required", label)
        return default
    if not isinstance(v, str):
        raise bad_request(f"{label} must be a string, got {_type_name(v)}", label)
    return v


def get_model_name(body: dict, name: str = "model", *, required: bool = False, label: str | None = None,
                   reference: bool = False) -> str | None:
    """A model name field, checked against the one grammar (store.model_name) before anything looks
    it up; absent or "" (the served model, where a route allows that) is returned as is. With
    `reference`, a blob digest is accepted too (what a model is made FROM)."""
    label = label or name
    value = get_str(body, name, required=required, label=label)
    if value:
        check_name_field(value, label, reference=reference)
    elif required:
        raise bad_request(f"{label} is required", label)
    return value


def check_name_field(value: str, label: str, *, reference: bool = False, what: str | None = None) -> str:
    """`value` if it is a well-formed model name, else a 400 naming `label` (and `what` in it)."""
    try:
        return (check_model_reference if reference else check_model_name)(value)
    except InvalidModelName as exc:
        where = f"{label}: {what}" if what else label
        raise bad_request(f"{where}: {exc}", label) from None


def model_field(body: dict) -> str:
    """The model a request names, as `model` or, from pre-0.2 Ollama clients, `name`: required."""
    for field in ("model", "name"):
        value = get_str(body, field)
        if value:
            return check_name_field(value, field)
    raise bad_request("model is required", "model")


def get_bool(body: dict, name: str, default: Any = None, *, label: str | None = None) -> Any:
    label = label or name
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{label} must be true or false, got {shown_value(v)}", label)
    return v


def get_int(body: dict, name: str, default: Any = None, *, lo: int | None = None, hi: int | None = None,
            label: str | None = None) -> Any:
    label = label or name
    v = body.get(name)
    if v is None:
        return default
    # JSON has one number type; 3.0 is accepted as 3, as Ollama's Go decoder does for options.
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{label} must be an integer, got {shown_value(v)}", label)
    if lo is not None and v < lo:
        raise bad_request(f"{label} must be at least {lo}, got {shown_value(v)}", label)
    if hi is not None and v > hi:
        raise bad_request(f"{label} must be at most {hi}, got {shown_value(v)}", label)
    return v


def get_float(body: dict, name: str, default: Any = None, *, label: str | None = None) -> Any:
    label = label or name
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"{label} must be a number, got {shown_value(v)}", label)
    try:
        f = float(v)  # an integer of hundreds of digits has no float: OverflowError, not inf
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise bad_request(f"{label} must be a finite number, got {shown_value(v)}", label)
    return f


def get_stop(body: dict, name: str = "stop", *, label: str | None = None) -> list[str]:
    """A stop string or a list of them (both APIs accept either)."""
    label = label or name
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise bad_request(f"{label} must be a string or a list of strings", label)


def joined_text(content: Any, where: str, part_text: Callable[[Any, str], str], what: str) -> str:
    """Text given as a string or as a list of parts (what: the list's name in the 400), each part's
    text read by part_text(part, its location)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or {what}", where)
    return "".join(part_text(part, f"{where}[{i}]") for i, part in enumerate(content))


def get_dict(body: dict, name: str, *, label: str | None = None) -> dict:
    label = label or name
    v = body.get(name)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad_request(f"{label} must be an object, got {_type_name(v)}", label)
    return v


def get_priority(body: dict, name: str = "priority"):
    """vLLM's integer priority (lower runs first, 0 normal) or a level name."""
    from tokenmill.engine import Priority

    v = body.get(name)
    if v is None:
        return Priority.NORMAL
    if isinstance(v, str) and v.lower() in ("high", "normal", "low"):
        return Priority[v.upper()]
    if isinstance(v, int) and not isinstance(v, bool):
        return Priority.HIGH if v < 0 else Priority.LOW if v > 0 else Priority.NORMAL
    raise bad_request(f"{name} must be an integer (lower runs first) or one of high, normal, low", name)
