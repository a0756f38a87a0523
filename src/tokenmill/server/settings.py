"""Server settings: command-line flags first, then TOKENMILL_* environment variables, then defaults.

`tokenmill serve` only parses MODEL, --host and --port today; every other knob is read from args
with getattr() so flags added to the parser later take effect without changes here."""
from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11434  # Ollama's, so Ollama clients work unconfigured


class SettingsError(ValueError):
    pass


@dataclass
class ServerSettings:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    dtype: str = "bf16"
    num_ctx: int | None = None          # per-sequence context; None = the model's own
    kv_size: int = 65536                # KV cache budget in tokens, shared by all sequences
    parallel: int = 64                  # sequences decoding at once
    n_batch: int = 512
    n_ubatch: int = 512
    max_queue: int = 256                # in-flight requests (running + waiting); more get 503
    drain_timeout: float = 30.0         # SIGTERM: seconds to let in-flight requests finish
    keep_alive_timeout: float = 5.0     # idle HTTP keep-alive connections are closed after this
    log_level: str = "info"


def parse_host_port(value: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """`host`, `host:port`, `:port`, `http://host:port` or `[::1]:port`, as OLLAMA_HOST accepts."""
    v = value.strip()
    for scheme in ("http://", "https://"):
        if v.startswith(scheme):
            v = v[len(scheme):]
    v = v.rstrip("/")
    if v.startswith("["):  # bracketed IPv6
        host, _, rest = v[1:].partition("]")
        port = rest.lstrip(":")
    elif v.count(":") == 1:
        host, port = v.split(":")
    else:
        host, port = v, ""
    try:
        port_num = int(port) if port else default_port
    except ValueError:
        raise SettingsError(f"invalid port in {value!r}") from None
    if not 0 <= port_num <= 65535:
        raise SettingsError(f"port out of range in {value!r}")
    return host or DEFAULT_HOST, port_num


def _env(name: str, cast, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a valid {cast.__name__}") from None


def load_settings(args=None) -> ServerSettings:
    def arg(name: str):
        return getattr(args, name, None) if args is not None else None

    s = ServerSettings()
    env_host = os.environ.get("TOKENMILL_HOST")
    if env_host:
        s.host, s.port = parse_host_port(env_host)
    if arg("host"):
        # --host may carry a port too (`--host 0.0.0.0:8080`), like OLLAMA_HOST.
        s.host, port = parse_host_port(arg("host"), s.port)
        s.port = port
    if arg("port") is not None:
        s.port = int(arg("port"))

    # (field, env var, type); a flag of the same name as the field wins over the env var.
    for field, env, cast in (
        ("dtype", "TOKENMILL_DTYPE", str),
        ("num_ctx", "TOKENMILL_CTX", int),
        ("kv_size", "TOKENMILL_KV_SIZE", int),
        ("parallel", "TOKENMILL_PARALLEL", int),
        ("n_batch", "TOKENMILL_BATCH", int),
        ("n_ubatch", "TOKENMILL_UBATCH", int),
        ("max_queue", "TOKENMILL_MAX_QUEUE", int),
        ("drain_timeout", "TOKENMILL_DRAIN_TIMEOUT", float),
        ("keep_alive_timeout", "TOKENMILL_KEEP_ALIVE", float),
        ("log_level", "TOKENMILL_LOG_LEVEL", str),
    ):
        value = arg(field)
        setattr(s, field, value if value is not None else _env(env, cast, getattr(s, field)))
    if s.dtype not in ("bf16", "fp32"):
        raise SettingsError(f"dtype must be bf16 or fp32, got {s.dtype!r}")
    for name in ("kv_size", "parallel", "n_batch", "n_ubatch", "max_queue"):
        if getattr(s, name) < 1:
            raise SettingsError(f"{name} must be at least 1, got {getattr(s, name)}")
    return s
