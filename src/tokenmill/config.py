"""One configuration for `tokenmill serve`: every server and engine setting, read from defaults, then
a TOML file (`--config PATH` or TOKENMILL_CONFIG), then TOKENMILL_* environment variables, then
command-line flags; each later source overrides the earlier ones. Every value is checked once, here,
with an error naming the setting, where the value came from, what was expected and what was given.

The file holds flat `key = value` lines with the keys of OPTIONS (`tokenmill serve --print-config`
prints a complete one). `host` may carry a port (`0.0.0.0:8080`, like OLLAMA_HOST) wherever it is set;
an explicit `port` from the same source or a later one wins over it."""
from __future__ import annotations

import argparse
import difflib
import ipaddress
import json
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing the engine pulls in torch: seconds that `tokenmill --help` should not pay
    from tokenmill.engine.config import EngineConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11434  # Ollama's, so Ollama clients work unconfigured
CONFIG_ENV = "TOKENMILL_CONFIG"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
POLICIES = ("fifo", "priority", "sjf")  # engine.config.POLICIES (a test keeps them equal)
DEFAULT_BLOCK_SIZE = 64  # engine.config.DEFAULT_BLOCK_SIZE (a test keeps them equal)
# More threads than any CPU has cores; far beyond it, a count overflowed the compiled pool's C int
# (a TypeError traceback at startup).
MAX_THREADS = 1024


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it and where its value came from."""


@dataclass(frozen=True)
class Option:
    name: str                        # the key in the file and the Config attribute
    kind: type                       # str, int, float or bool
    default: Any
    help: str
    flags: tuple[str, ...] = ()      # command-line spellings; the first is the one shown
    env: tuple[str, ...] = ()        # extra (older) environment names besides TOKENMILL_<NAME>
    choices: tuple[str, ...] | None = None
    lo: float | None = None          # smallest allowed value
    hi: float | None = None
    zero_ok: bool = False            # 0 is allowed below lo (means "automatic")
    group: str = "engine"

    @property
    def env_names(self) -> tuple[str, ...]:
        return (f"TOKENMILL_{self.name.upper()}", *self.env)


OPTIONS: tuple[Option, ...] = (
    # --- server ---------------------------------------------------------------------------------
    Option("model", str, "smollm2", "model to serve: a catalog name (pulled on first use) or a .gguf path",
           group="server"),
    Option("host", str, DEFAULT_HOST, "address to listen on; may carry a port (host:port)", ("--host",),
           group="server"),
    Option("port", int, DEFAULT_PORT, "port to listen on", ("--port",), lo=0, hi=65535, group="server"),
    Option("max_queue", int, 256, "most in-flight requests (running + waiting); more get 503", ("--max-queue",),
           lo=1, group="server"),
    Option("drain_timeout", float, 30.0, "seconds in-flight requests get to finish on SIGTERM", ("--drain-timeout",),
           lo=0, group="server"),
    Option("http_keep_alive", float, 5.0, "seconds an idle HTTP keep-alive connection stays open",
           ("--http-keep-alive",), lo=0, group="server"),
    Option("keep_alive", str, "5m", "how long a model stays loaded after its last request, as Ollama's keep_alive: "
           "a duration (\"5m\", \"1h\") or seconds; negative = forever, 0 = unload after each request. The "
           "model named to serve stays loaded until a request says otherwise", ("--keep-alive",),
           env=("OLLAMA_KEEP_ALIVE",), group="server"),
    Option("max_loaded_models", int, 3, "most models loaded at once; loading another unloads the least recently "
           "used idle one", ("--max-loaded-models",), env=("OLLAMA_MAX_LOADED_MODELS",), lo=1, group="server"),
    Option("max_memory_gb", float, 0.0, "memory budget for loaded models (weights + KV caches) in GB; 0 = 75% of "
           "the machine's RAM", ("--max-memory-gb",), lo=0.001, zero_ok=True, group="server"),
    Option("pull_on_demand", bool, False, "a request naming a known model that is not installed pulls it "
           "(otherwise: 404, as Ollama)", ("--pull-on-demand",), group="server"),
    Option("model_wait_timeout", float, 120.0, "seconds a request waits for its model to load or for memory to "
           "free up before it gets 503", ("--model-wait-timeout",), lo=0.1, group="server"),
    Option("log_level", str, "info", "log level", ("--log-level",), choices=LOG_LEVELS, group="server"),
    Option("api_key", str, "", "require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every route but "
           "/health; empty = no key", ("--api-key",), group="server"),
    Option("origins", str, "", "extra CORS origins allowed to call the API, comma-separated, `*` wildcards "
           "(as OLLAMA_ORIGINS); localhost origins are always allowed", ("--origins",), env=("OLLAMA_ORIGINS",),
           group="server"),
    Option("lora_modules", str, "", "LoRA adapters served as models, as vLLM's --lora-modules: NAME=FILE, "
           "comma-separated; each becomes model NAME, the served model with that adapter merged in (as `create` "
           "with ADAPTER makes it, kept in the store)", ("--lora-modules",), group="server"),
    Option("header_timeout", float, 10.0, "seconds a new connection gets to send its request headers; slower "
           "ones are closed (slowloris)", ("--header-timeout",), lo=0.1, group="server"),
    Option("body_timeout", float, 30.0, "seconds a request gets to send its whole body once its headers are in; "
           "slower ones get 408 (slowloris)", ("--body-timeout",), lo=0.1, group="server"),
    Option("max_body_bytes", int, 32 * 1024 * 1024, "largest request body accepted; larger ones get 413",
           ("--max-body-bytes",), lo=1024, group="server"),
    Option("max_blob_gb", float, 16.0, "largest blob (a GGUF file pushed to /api/blobs) accepted, in GB; larger "
           "uploads get 413", ("--max-blob-gb",), lo=0.000001, group="server"),
    Option("allowed_hosts", str, "", "extra Host header names the server answers to when it listens on loopback, "
           "comma-separated (DNS rebinding guard; loopback names and addresses are always allowed; `*` = any)",
           ("--allowed-hosts",), env=("TOKENMILL_ALLOWED_HOSTS",), group="server"),
    Option("ssl_certfile", str, "", "serve HTTPS with this certificate (PEM; with --ssl-keyfile), as vLLM's "
           "--ssl-certfile; empty = plain HTTP", ("--ssl-certfile",), group="server"),
    Option("ssl_keyfile", str, "", "the certificate's private key (PEM)", ("--ssl-keyfile",), group="server"),
    # --- engine ---------------------------------------------------------------------------------
    Option("dtype", str, "auto", "weights and activations: gguf (weights stay in their GGUF blocks, native "
           "kernels, float32 activations), bf16, fp32, or auto (gguf where the compiled core runs, else bf16 on "
           "CPUs with a bf16 path, else fp32)", ("--dtype",), choices=("auto", "gguf", "bf16", "fp32")),
    Option("kv_dtype", str, "auto", "KV cache dtype: f16, bf16, int8 (per-token, per-head scales; half the "
           "memory and reads, native kernels only) or auto (f16 with the native kernels, else the compute dtype)",
           ("--kv-dtype",), choices=("auto", "f16", "bf16", "int8")),
    Option("num_ctx", int, 0, "context per sequence in tokens (max_model_len); 0 = the model's own",
           ("--ctx", "--num-ctx"), env=("TOKENMILL_CTX",), lo=2, zero_ok=True),
    Option("kv_size", int, 65536, "KV cache size in tokens, shared by all sequences (max_total_tokens)",
           ("--kv-size",), lo=16),
    Option("block_size", int, DEFAULT_BLOCK_SIZE, "tokens per KV cache block", ("--block-size",), lo=1),
    Option("parallel", int, 0, "most sequences running at once; 0 = 64 on a CPU, 256 on a GPU", ("--parallel",),
           lo=1, zero_ok=True),
    Option("n_batch", int, 0, "token budget of one engine step (decodes + prefill chunks); 0 = 512 on a CPU, "
           "8192 on a GPU", ("--batch-size",), env=("TOKENMILL_BATCH",), lo=1, zero_ok=True),
    Option("n_ubatch", int, 0, "most tokens one model call processes; 0 = 512 on a CPU, 8192 on a GPU",
           ("--ubatch-size",), env=("TOKENMILL_UBATCH",), lo=1, zero_ok=True),
    Option("prefix_cache", bool, True, "reuse the KV blocks of prompt prefixes across requests",
           ("--prefix-cache",)),
    Option("policy", str, "fifo", "waiting-queue order: fifo, priority (request priority first) or sjf "
           "(shortest job first, with ageing)", ("--policy",), choices=POLICIES),
    Option("aging_ms", float, 10.0, "sjf: each aging_ms of waiting counts as one token less of work",
           ("--aging-ms",), lo=0.001),
    Option("max_wait_ms", float, 0.0, "an idle engine waits up to this long for a burst of requests to "
           "start as one batch; 0 = never", ("--max-wait-ms",), lo=0),
    Option("threads", int, 0, "compute threads, for the whole process (every model it loads); 0 = physical "
           "cores within affinity and cgroup quota. On a shared machine fewer is steadier: busy-waiting threads "
           "that lose their core slow every step", ("--threads",), lo=1, hi=MAX_THREADS, zero_ok=True),
    Option("max_tokens", int, 0, "most tokens one request may generate, whatever it asks (Ollama's num_predict "
           "-1 and -2 stop here too); 0 = the model's context length", ("--max-tokens",), lo=1, zero_ok=True),
    Option("request_timeout", float, 0.0, "seconds after which a request is finished (with `length`), waiting or "
           "running; 0 = no deadline", ("--request-timeout",), lo=0),
    Option("watchdog_seconds", float, 10.0, "log an engine step that runs longer than this, with its batch "
           "shape; 0 = off", ("--watchdog-seconds",), lo=0),
    Option("compile", bool, True, "compile model steps with torch.compile (about a minute per graph the first "
           "time, cached on disk after); --no-compile runs every step eagerly", ("--compile",)),
    Option("device", str, "auto", "where models run: cpu, cuda (an NVIDIA GPU: bf16 weights dequantized on the "
           "GPU, the KV cache in GPU memory, decode steps as CUDA graphs unless --no-compile), or auto (cuda when "
           "torch sees one, else cpu)", ("--device",), choices=("auto", "cpu", "cuda")),
    Option("gpu_memory_utilization", float, 0.9, "cuda: the share of the GPU's free memory a model may take for "
           "its weights, KV cache and workspace; the KV cache gets what is left, up to kv_size",
           ("--gpu-memory-utilization",), lo=0.01, hi=1.0),
    Option("decode_steps", int, 0, "cuda: decode steps a batch of requests without grammar or logprobs runs "
           "back to back on the GPU before the host reads their tokens (the host's share of a step is paid once for all of "
           "them); 0 = 4 on a GPU, 1 elsewhere", ("--decode-steps",), lo=1, hi=64, zero_ok=True),
    Option("speculative", str, "ngram", "speculative decoding for requests that do not choose: ngram (prompt "
           "lookup: a sequence proposes what followed its last few tokens earlier in its context, verified in the "
           "same step; greedy and seeded output unchanged), draft:MODEL (an installed model with the same vocabulary "
           "decodes the proposals; its own KV cache) or off", ("--speculative",)),
    Option("num_speculative_tokens", int, 16, "most tokens a sequence proposes per step (fewer when its proposals "
           "are seldom accepted or the batch is large)", ("--num-speculative-tokens",), lo=1, hi=16),
    Option("spec_ngram_min", int, 2, "prompt lookup: the shortest suffix looked up (1 also proposes after a "
           "1-token match, whose tokens are seldom accepted)", ("--spec-ngram-min",), lo=1, hi=16),
    Option("spec_ngram_max", int, 8, "prompt lookup: the longest suffix looked up (tried first)",
           ("--spec-ngram-max",), lo=1, hi=16),
)
BY_NAME = {o.name: o for o in OPTIONS}


@dataclass
class Config:
    """The effective settings; one field per entry of OPTIONS, in the same order, with its default."""
    model: str = "smollm2"
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_queue: int = 256
    drain_timeout: float = 30.0
    http_keep_alive: float = 5.0
    keep_alive: str = "5m"
    max_loaded_models: int = 3
    max_memory_gb: float = 0.0
    pull_on_demand: bool = False
    model_wait_timeout: float = 120.0
    log_level: str = "info"
    api_key: str = ""
    origins: str = ""
    lora_modules: str = ""
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_body_bytes: int = 32 * 1024 * 1024
    max_blob_gb: float = 16.0
    allowed_hosts: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    dtype: str = "auto"
    kv_dtype: str = "auto"
    num_ctx: int = 0
    kv_size: int = 65536
    block_size: int = DEFAULT_BLOCK_SIZE
    parallel: int = 0
    n_batch: int = 0
    n_ubatch: int = 0
    prefix_cache: bool = True
    policy: str = "fifo"
    aging_ms: float = 10.0
    max_wait_ms: float = 0.0
    threads: int = 0
    max_tokens: int = 0
    request_timeout: float = 0.0
    watchdog_seconds: float = 10.0
    compile: bool = True
    device: str = "auto"
    gpu_memory_utilization: float = 0.9
    decode_steps: int = 0
    speculative: str = "ngram"
    num_speculative_tokens: int = 16
    spec_ngram_min: int = 2
    spec_ngram_max: int = 8
    # Where each value came from: "default", "config file PATH", "env NAME", "flag --name", "argument MODEL".
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    config_file: Path | None = field(default=None, compare=False, repr=False)

    def engine_config(self) -> EngineConfig:
        from tokenmill.engine.config import EngineConfig

        return EngineConfig(dtype=self.dtype, kv_dtype=self.kv_dtype, block_size=self.block_size, max_total_tokens=self.kv_size,
                            max_model_len=self.num_ctx or None, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                            parallel=self.parallel, enable_prefix_caching=self.prefix_cache, policy=self.policy,
                            aging_ms=self.aging_ms, max_wait_ms=self.max_wait_ms, threads=self.threads,
                            compile=self.compile, max_new_tokens=self.max_tokens or None,
                            request_timeout=self.request_timeout, watchdog_seconds=self.watchdog_seconds,
                            device=self.device, gpu_memory_utilization=self.gpu_memory_utilization,
                            decode_steps=self.decode_steps, speculative=self.speculative, num_speculative_tokens=self.num_speculative_tokens,
                            spec_ngram_min=self.spec_ngram_min, spec_ngram_max=self.spec_ngram_max)

    def keep_alive_seconds(self) -> float | None:
        """The keep_alive setting in seconds; None = forever."""
        from tokenmill.keep_alive import parse_keep_alive

        return parse_keep_alive(self.keep_alive)

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")

    def to_toml(self) -> str:
        """The effective values as a config file, each with its source as a comment."""
        lines = ["# tokenmill serve: effective configuration",
                 f"# config file: {self.config_file or 'none'}"]
        for group in ("server", "engine"):
            lines += ["", f"# --- {group} ---"]
            for o in OPTIONS:
                if o.group == group:
                    lines += [f"# {o.help}", f"{o.name} = {_toml_value(getattr(self, o.name))}  # {self.source(o.name)}"]
        return "\n".join(lines) + "\n"



def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    return repr(v)


# --- reading values -------------------------------------------------------------------------------
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(o: Option, value: Any, source: str, from_text: bool) -> Any:
    """value as o.kind, or a ConfigError naming the source, the key, the expected type and the value."""
    def wrong() -> ConfigError:
        return ConfigError(f"{source}: {o.name} must be {_TYPE_NAMES[o.kind]}, got {value!r}")

    if from_text:  # environment variables and flags arrive as text
        text = str(value).strip()
        if o.kind is str:
            return text
        if o.kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise wrong()
        try:
            return o.kind(text)
        except ValueError:
            raise wrong() from None
    # TOML values keep their types: no strings for numbers, but an int is a fine float.
    if o.kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (o.kind is bool) or not isinstance(value, o.kind):
        raise wrong()
    return value


def _check(o: Option, value: Any, source: str) -> None:
    # nan passes every bound (each comparison is False) and inf fails later, where seconds become
    # ints (int(inf): a traceback at startup); neither is a setting, from any source (TOML has both).
    if o.kind is float and not math.isfinite(value):
        raise ConfigError(f"{source}: {o.name} must be a finite number, got {value}")
    if o.choices is not None and value not in o.choices:
        raise ConfigError(f"{source}: {o.name} must be one of {', '.join(o.choices)}, got {value!r}")
    if o.zero_ok and value == 0:
        return
    if o.lo is not None and value < o.lo:
        raise ConfigError(f"{source}: {o.name} must be at least {o.lo:g}{' (or 0)' if o.zero_ok else ''}, got {value}")
    if o.hi is not None and value > o.hi:
        raise ConfigError(f"{source}: {o.name} must be at most {o.hi:g}, got {value}")


def split_host_port(value: str) -> tuple[str, int | None]:
    """`host`, `host:port`, `:port`, `http://host:port` or `[::1]:port`, as OLLAMA_HOST accepts;
    the port is None when the value has none."""
    v = value.strip()
    for scheme in ("http://", "https://"):
        if v.lower().startswith(scheme):
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
        port_num = int(port) if port else None
    except ValueError:
        raise ConfigError(f"invalid port in {value!r}") from None
    if port_num is not None and not 0 <= port_num <= 65535:
        raise ConfigError(f"port out of range in {value!r}")
    if not _plausible_host(host):
        raise ConfigError(f"invalid host in {value!r}")
    return host or DEFAULT_HOST, port_num


def _plausible_host(host: str) -> bool:
    """A name or an address that could be looked up: a colon only in an IPv6 address, and none of
    the characters a URL gives other meanings (whether a name exists is for the lookup to say)."""
    if any(c.isspace() or c in "/?#@[]" for c in host):
        return False
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
    return True


def parse_host_port(value: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    host, port = split_host_port(value)
    return host, default_port if port is None else port


# One source's values: name -> (value, source label).
Layer = dict[str, tuple[Any, str]]


def _layer(values: Mapping[str, tuple[Any, str]], from_text: bool) -> Layer:
    out: Layer = {}
    for name, (raw, source) in values.items():
        o = BY_NAME[name]
        value = _convert(o, raw, source, from_text)
        if name == "host":
            try:
                value, port = split_host_port(value)
            except ConfigError as exc:
                raise ConfigError(f"{source}: {exc}") from None
            if port is not None and "port" not in values:
                out["port"] = (port, source)
        _check(o, value, source)
        out[name] = (value, source)
    return out


def read_file(path: Path) -> Layer:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:  # TOML is UTF-8; tomllib decodes before it parses
        raise ConfigError(f"config file {path} is not valid UTF-8") from None
    for key in data:
        if key not in BY_NAME:
            close = difflib.get_close_matches(key, BY_NAME, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"config file {path}: unknown setting {key!r}{hint}; "
                              f"known settings: {', '.join(BY_NAME)}")
    return _layer({k: (v, f"config file {path}") for k, v in data.items()}, from_text=False)


def read_env(env: Mapping[str, str]) -> Layer:
    values = {}
    for o in OPTIONS:
        for name in o.env_names:
            raw = env.get(name)
            if raw is not None and raw.strip() != "":  # empty = unset
                values[o.name] = (raw, f"env {name}")
                break
    return _layer(values, from_text=True)


def read_flags(args: argparse.Namespace | None) -> Layer:
    """Flags that were given: an unset flag is None (or absent from a hand-made Namespace)."""
    if args is None:
        return {}
    values = {}
    for o in OPTIONS:
        value = getattr(args, o.name, None)
        if value is None:
            continue
        if o.name == "model":
            label = "argument MODEL"
        elif o.kind is bool and value is False:
            label = f"flag --no-{o.flags[0].removeprefix('--')}"
        else:
            label = f"flag {o.flags[0]}"
        values[o.name] = (value, label)
    return _layer(values, from_text=True)


def load_config(args: argparse.Namespace | None = None, *, env: Mapping[str, str] | None = None,
                config_file: str | Path | None = None) -> Config:
    """defaults < file < environment < flags. The file is config_file, else args.config, else
    $TOKENMILL_CONFIG, else none."""
    env = os.environ if env is None else env
    path = config_file or getattr(args, "config", None) or env.get(CONFIG_ENV) or None
    cfg = Config(config_file=Path(path) if path else None)
    layers = [read_file(Path(path)) if path else {}, read_env(env), read_flags(args)]
    for layer in layers:
        for name, (value, source) in layer.items():
            setattr(cfg, name, value)
            cfg.sources[name] = source
    try:
        cfg.keep_alive_seconds()
    except ValueError as exc:
        raise ConfigError(f"{cfg.source('keep_alive')}: {exc}") from None
    # The form only (engine.speculative.config parses it; importing it here would load torch).
    draft_model = cfg.speculative[len("draft:"):].strip() if cfg.speculative.startswith("draft:") else ""
    if cfg.speculative not in ("off", "ngram") and not draft_model:
        raise ConfigError(f"speculative ({cfg.source('speculative')}) must be off, ngram or draft:MODEL, "
                          f"got {cfg.speculative!r}")
    # The one relation between settings (each value alone was checked above). A maximum set below the
    # default minimum asks for shorter lookups: the minimum follows it (as vLLM's prompt_lookup_min,
    # unset, follows prompt_lookup_max); a minimum set explicitly above the maximum is an error.
    if cfg.spec_ngram_min > cfg.spec_ngram_max and cfg.source("spec_ngram_min") == "default":
        cfg.spec_ngram_min = cfg.spec_ngram_max
        cfg.sources["spec_ngram_min"] = f"default, lowered to spec_ngram_max ({cfg.source('spec_ngram_max')})"
    if cfg.spec_ngram_min > cfg.spec_ngram_max:
        raise ConfigError(f"spec_ngram_min ({cfg.spec_ngram_min}, {cfg.source('spec_ngram_min')}) is above "
                          f"spec_ngram_max ({cfg.spec_ngram_max}, {cfg.source('spec_ngram_max')})")
    if cfg.kv_size < cfg.block_size:
        raise ConfigError(f"kv_size ({cfg.kv_size}, {cfg.source('kv_size')}) is below one block "
                          f"(block_size {cfg.block_size}, {cfg.source('block_size')})")
    return cfg


# --- command line ---------------------------------------------------------------------------------
def add_flags(parser: argparse.ArgumentParser) -> None:
    """The serve flags of every option that has one. All default to None (= not given), so unset
    flags fall back to the environment, the file and the defaults."""
    for o in OPTIONS:
        if not o.flags:
            continue
        env = ", ".join(o.env_names)
        # argparse formats help strings with %: a literal one ("75% of") must be doubled.
        help_ = f"{o.help} (env {env}; default {_toml_value(o.default)})".replace("%", "%%")
        if o.kind is bool:
            parser.add_argument(*o.flags, dest=o.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_)
        else:
            parser.add_argument(*o.flags, dest=o.name, default=None, choices=o.choices, help=help_,
                                metavar=None if o.choices else o.name.upper())
