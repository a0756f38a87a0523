"""Modelfile-lite: the Ollama Modelfile directives that need no new weights. FROM names the base
model; PARAMETER sets a default option (repeatable for `stop`); SYSTEM, TEMPLATE and MESSAGE set the
system prompt, the chat template and leading messages; ADAPTER (repeatable) a LoRA adapter merged into
the base's weights (store/adapters.py). Values may be quoted, or span lines inside triple quotes.
LICENSE and REQUIRES are not supported and say so."""
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
# Runner and hardware options that mean nothing here (and mirostat, not supported), with their Ollama
# types: a Modelfile written for Ollama sets some of them (PARAMETER mirostat 0, num_gpu 99), so they
# are type-checked as Ollama does and then dropped, not refused. Requests' options take them too
# (server/ollama_params.py).
IGNORED_PARAMETER_TYPES = {
    "num_batch": int, "num_gpu": int, "main_gpu": int, "num_thread": int, "num_gqa": int,
    "use_mmap": bool, "use_mlock": bool, "numa": bool, "low_vram": bool, "f16_kv": bool,
    "vocab_only": bool, "logits_all": bool, "embedding_only": bool, "penalize_newline": bool,
    "mirostat": int, "mirostat_tau": float, "mirostat_eta": float, "tfs_z": float,
    "rope_frequency_base": float, "rope_frequency_scale": float,
}
_ROLES = ("system", "user", "assistant")
_DIRECTIVE = re.compile(r"^\s*([A-Za-z]+)\s*(.*)$", re.S)


class ModelfileError(StoreError):
    pass


@dataclass(frozen=True)
class Modelfile:
    base: str
    profile: Profile
    adapters: tuple[str, ...] = ()  # as written: a file (the CLI pushes it) or a blob digest


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
    typed = typed_parameter(name, _unquote(value), f"line {number}")
    if name == "stop":
        params.setdefault("stop", []).append(typed)
    elif typed is not None:
        params[name] = typed


def typed_parameter(name: str, value: str, where: str) -> int | float | str | None:
    """A PARAMETER's value as its option's type (None for an option that means nothing here, once
    type-checked as Ollama checks it); errors begin with `where` (a Modelfile line, a command)."""
    if name not in PARAMETER_TYPES and name not in IGNORED_PARAMETER_TYPES:
        raise ModelfileError(f"{where}: unknown PARAMETER {name!r}; known: {', '.join(sorted(PARAMETER_TYPES))}")
    if not value:
        raise ModelfileError(f"{where}: PARAMETER {name} needs a value")
    if name in IGNORED_PARAMETER_TYPES:
        kind = IGNORED_PARAMETER_TYPES[name]
        if kind is bool and value.lower() not in ("true", "false"):
            raise ModelfileError(f"{where}: PARAMETER {name} must be true or false, got {value!r}")
        if kind is not bool:
            _typed(where, name, kind, value)
        return None  # checked, and dropped: it means nothing here
    return value if name == "stop" else _typed(where, name, PARAMETER_TYPES[name], value)


def _typed(where: str, name: str, kind: type, value: str) -> int | float:
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ModelfileError(f"{where}: PARAMETER {name} must be {what}, got {value!r}") from None


def parse_modelfile(text: str) -> Modelfile:
    base, system, template, params, messages, adapters = None, None, None, {}, [], []
    for number, line in _lines(text):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _DIRECTIVE.match(line)
        if m is None:
            raise ModelfileError(f"line {number}: expected a directive (FROM, ADAPTER, PARAMETER, SYSTEM, TEMPLATE, "
                                 "MESSAGE)")
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
        elif directive == "ADAPTER":
            adapter = _unquote(rest)
            if not adapter:
                raise ModelfileError(f"line {number}: ADAPTER needs a file or a blob digest")
            adapters.append(adapter)
        elif directive in ("LICENSE", "REQUIRES"):
            raise ModelfileError(f"line {number}: {directive} is not supported by tokenmill")
        else:
            raise ModelfileError(f"line {number}: unknown directive {directive}")
    if not base:
        raise ModelfileError("a Modelfile needs a FROM line naming the base model")
    return Modelfile(base, Profile(system, template, params, tuple(messages)), tuple(adapters))
