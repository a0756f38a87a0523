"""Ollama's keep_alive: how long a model stays loaded after a request. A Go duration ("5m",
"1h30m", "-1s"), or a number of seconds; 0 unloads right after the request, any negative value keeps
the model loaded forever. Parsed into seconds, with None meaning forever; so is a duration longer
than any Go duration (Ollama's type for it), which no clock could count down anyway."""
from __future__ import annotations

import json
import math
import re

FOREVER = None
# The longest Go time.Duration (2**63 - 1 ns, about 292 years): longer is forever. A model's expiry,
# now plus this, stays a date /api/ps can write (years past 9999 are not).
MAX_SECONDS = (2**63 - 1) / 1e9
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


class KeepAliveError(ValueError):
    pass


def _shown(value: object, limit: int = 60) -> str:
    """The value as the client sent it (JSON), cut short: an error never echoes a megabyte back."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_keep_alive(value: object) -> float | None:
    """Seconds to stay loaded (0 = unload now), or None for forever."""
    if isinstance(value, bool):
        raise KeepAliveError(f"keep_alive must be a duration such as \"5m\" or a number of seconds, got {_shown(value)}")
    if isinstance(value, int):
        seconds = float(max(min(value, 2**64), -1))  # a JSON integer may be too large for a float
    elif isinstance(value, float):
        seconds = value
    elif isinstance(value, str):
        seconds = _parse_text(value.strip())
    else:
        raise KeepAliveError(f"keep_alive must be a duration such as \"5m\" or a number of seconds, got {_shown(value)}")
    if math.isnan(seconds):
        raise KeepAliveError("keep_alive must be a number, got NaN")
    if seconds < 0 or seconds > MAX_SECONDS:
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
        raise KeepAliveError(f"keep_alive: {_shown(text)} is not a duration (examples: \"5m\", \"1h30m\", \"30s\", \"-1\")")
    return sign * total
