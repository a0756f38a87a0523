"""Modelfile-lite: the Ollama Modelfile directives that need no new weights. FROM names the base
model; PARAMETER sets a default option (repeatable for `stop`); SYSTEM, TEMPLATE and MESSAGE set the
system prompt, the chat template and leading messages. Values may be quoted, or span lines inside
triple quotes. ADAPTER, LICENSE and REQUIRES are not supported and say so."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tokenmill.store.catalog import StoreError
from tokenmill.store.derived import Profile

# Option name -> type, for the PARAMETERs Ollama documents (and the sampling options we also take).
PARAMETER_TYPES = {
    "num_ctx": int, "num_predict": int, "num_keep": int, "seed": int, "top_k": int, "repeat_last_n": int,
    "temperature": float, "top_p": float, "min_p": float, "typical_p": float, "repeat_penalty": float,
    "presence_penalty": float, "frequency_penalty": float, "stop": str,
}
_ROLES = ("system", "user", "assistant")
_DIRECTIVE = re.compile(r"^\s*([A-Za-z]+)\s*(.*)$", re.S)


class ModelfileError(StoreError):
    pass


@dataclass(frozen=True)
class Modelfile:
    base: str
    profile: Profile


def _lines(text: str):
    """Logical lines: a `\"\"\"` value runs until its closing quotes."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line, number = lines[i], i + 1
        i += 1
        if line.count('"""') == 1:
            while i < len(lines):
                line += "\n" + lines[i]
                i += 1
                if '"""' in lines[i - 1]:
                    break
            else:
                raise ModelfileError(f"line {number}: unterminated \"\"\"")
        yield number, line


def _unquote(value: str) -> str:
    """The value of a directive; a triple-quoted one exactly as written (a TEMPLATE's newlines matter)."""
    v = value.strip()
    if v.startswith('"""') and v.endswith('"""') and len(v) >= 6:
        return v[3:-3]
    if len(v) >= 2 and v[0] == v[-1] == '"':
        try:
            return json.loads(v)
        except ValueError:
            return v[1:-1]
    return v


def _parameter(number: int, rest: str, params: dict) -> None:
    name, _, value = rest.strip().partition(" ")
    name = name.lower()
    if name not in PARAMETER_TYPES:
        raise ModelfileError(f"line {number}: unknown PARAMETER {name!r}; known: {', '.join(sorted(PARAMETER_TYPES))}")
    value = _unquote(value)
    if not value:
        raise ModelfileError(f"line {number}: PARAMETER {name} needs a value")
    if name == "stop":
        params.setdefault("stop", []).append(value)
        return
    kind = PARAMETER_TYPES[name]
    try:
        params[name] = kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ModelfileError(f"line {number}: PARAMETER {name} must be {what}, got {value!r}") from None


def parse_modelfile(text: str) -> Modelfile:
    base, system, template, params, messages = None, None, None, {}, []
    for number, line in _lines(text):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _DIRECTIVE.match(line)
        if m is None:
            raise ModelfileError(f"line {number}: expected a directive (FROM, PARAMETER, SYSTEM, TEMPLATE, MESSAGE)")
        directive, rest = m.group(1).upper(), m.group(2)
        if directive == "FROM":
            base = _unquote(rest)
        elif directive == "PARAMETER":
            _parameter(number, rest, params)
        elif directive == "SYSTEM":
            system = _unquote(rest).strip()
        elif directive == "TEMPLATE":
            template = _unquote(rest)
        elif directive == "MESSAGE":
            role, _, content = rest.strip().partition(" ")
            if role.lower() not in _ROLES:
                raise ModelfileError(f"line {number}: MESSAGE role must be one of {', '.join(_ROLES)}, got {role!r}")
            messages.append({"role": role.lower(), "content": _unquote(content).strip()})
        elif directive in ("ADAPTER", "LICENSE", "REQUIRES"):
            raise ModelfileError(f"line {number}: {directive} is not supported by tokenmill")
        else:
            raise ModelfileError(f"line {number}: unknown directive {directive}")
    if not base:
        raise ModelfileError("a Modelfile needs a FROM line naming the base model")
    return Modelfile(base, Profile(system, template, params, tuple(messages)))
