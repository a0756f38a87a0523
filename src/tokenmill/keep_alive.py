"""Ollama's keep_alive: how long a model stays loaded after a request. A Go duration ("5m",
"1h30m", "-1s"), or a number of seconds; 0 unloads right after the request, any negative value keeps
the model loaded forever. Parsed into seconds, with None meaning forever."""
from __future__ import annotations

import math
import re

FOREVER = None
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


class KeepAliveError(ValueError):
    pass


def parse_keep_alive(value: object) -> float | None:
    """Seconds to stay loaded (0 = unload now), or None for forever."""
    if isinstance(value, bool):
        raise KeepAliveError(f"keep_alive must be a duration such as \"5m\" or a number of seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_text(value.strip())
    else:
        raise KeepAliveError(f"keep_alive must be a duration such as \"5m\" or a number of seconds, got {value!r}")
    if math.isnan(seconds):
        raise KeepAliveError("keep_alive must be a number, got NaN")
    if seconds < 0 or math.isinf(seconds):
        return FOREVER
    return seconds


def _parse_text(text: str) -> float:
    try:
        return float(text)  # "300" is seconds, as Ollama reads a bare number
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    pos, total = 0, 0.0
    for m in _PART.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise KeepAliveError(f"keep_alive: {text!r} is not a duration (examples: \"5m\", \"1h30m\", \"30s\", \"-1\")")
    return sign * total
