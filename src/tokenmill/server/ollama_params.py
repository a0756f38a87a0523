"""Ollama request options -> SamplingParams, with Ollama's defaults (which differ from the engine's:
top_k 40, top_p 0.9, repeat_penalty 1.1) made explicit, and errors naming `options.<field>`."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine import SamplingParams
from tokenmill.engine.sampling_params import MAX_SPECULATIVE_TOKENS, InvalidSamplingParams
from tokenmill.server.errors import bad_request
from tokenmill.server.validation import get_bool, get_dict, get_float, get_int, get_stop, warn_once, warn_unknown
from tokenmill.store.modelfile import IGNORED_PARAMETER_TYPES

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "typical_p": 1.0,
            "repeat_penalty": 1.1, "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0}

# Runner and hardware options that mean nothing here: type-checked as Ollama does, then ignored.
IGNORED_TYPES = IGNORED_PARAMETER_TYPES
IGNORED = set(IGNORED_TYPES)
# speculative, num_speculative_tokens: tokenmill's own (engine/speculative/), per request.
KNOWN = {"num_keep", "num_ctx", "num_predict", "seed", "stop", "speculative", "num_speculative_tokens", *DEFAULTS,
         *IGNORED}

# SamplingParams field -> the name the client used, for error messages.
FIELD_NAMES = {"max_tokens": "options.num_predict", "repeat_penalty": "options.repeat_penalty",
               **{k: f"options.{k}" for k in DEFAULTS if k != "repeat_penalty"},
               "seed": "options.seed", "stop": "options.stop", "top_logprobs": "top_logprobs"}


# Ollama's default num_keep: a context shift or truncation never drops the first few tokens (BOS,
# the start of the template).
DEFAULT_NUM_KEEP = 4


@dataclass
class OllamaOptions:
    params: SamplingParams
    num_ctx: int | None
    num_keep: int  # -1: the whole prompt
    fill_context: bool = False  # num_predict -2: stop when the context is full (never shift)


def parse_options(body: dict, where: str, *, prefix: str = "options.") -> OllamaOptions:
    """`prefix` starts each field's name in error messages (a derived model's PARAMETERs are checked
    by this too, see check_options)."""
    opts = get_dict(body, "options")
    warn_unknown(opts, KNOWN, f"{where} options")

    def f(name: str) -> float:
        return get_float(opts, name, DEFAULTS[name], label=f"{prefix}{name}")

    def i(name: str, default=None, **kw):
        return get_int(opts, name, default, label=f"{prefix}{name}", **kw)

    # num_predict: -1 = until the model stops (shifting the context as needed), -2 = until the model
    # stops or the context is full; neither caps max_tokens.
    num_predict = i("num_predict", -1, lo=-2)
    seed = i("seed")
    top_logprobs = get_int(body, "top_logprobs", 0, lo=0)
    params = SamplingParams(
        max_tokens=num_predict if num_predict > 0 else None,
        temperature=f("temperature"),
        top_k=i("top_k", DEFAULTS["top_k"]),
        top_p=f("top_p"),
        min_p=f("min_p"),
        typical_p=f("typical_p"),
        repeat_penalty=f("repeat_penalty"),
        repeat_last_n=i("repeat_last_n", DEFAULTS["repeat_last_n"]),
        presence_penalty=f("presence_penalty"),
        frequency_penalty=f("frequency_penalty"),
        seed=seed if seed is not None and seed >= 0 else None,  # Ollama's -1 means random
        stop=get_stop(opts, "stop", label=f"{prefix}stop"),
        logprobs=bool(get_bool(body, "logprobs", False)) or top_logprobs > 0,
        top_logprobs=top_logprobs,
        speculative=get_bool(opts, "speculative", None, label=f"{prefix}speculative"),
        num_speculative_tokens=i("num_speculative_tokens", lo=0, hi=MAX_SPECULATIVE_TOKENS),
    )
    _check_ignored(opts, where, prefix)
    # Ollama treats top_k <= 0 as "off".
    if params.top_k < 0:
        params.top_k = 0
    return OllamaOptions(params, i("num_ctx", lo=2), i("num_keep", DEFAULT_NUM_KEEP, lo=-1), num_predict == -2)


def _check_ignored(opts: dict, where: str, prefix: str) -> None:
    """Ignored options are still type-checked; mirostat asked for (1 or 2) is logged, since the
    sampling it names does not happen here (Ollama's own engine ignores it too)."""
    for name, kind in IGNORED_TYPES.items():
        label = f"{prefix}{name}"
        if kind is bool:
            get_bool(opts, name, label=label)
        elif kind is int:
            get_int(opts, name, label=label)
        else:
            get_float(opts, name, label=label)
    if opts.get("mirostat"):
        warn_once(where, "mirostat", "mirostat sampling is not supported; top_k/top_p/min_p sampling is used")


def check_options(options: dict, where: str, prefix: str) -> None:
    """400 for options a request carrying them would get a 400 for, by the very same checks (the
    request's own, then the sampling parameters' ranges): a derived model's PARAMETERs are checked
    so when it is created, not on each later request that never sent them."""
    params = parse_options({"options": options}, where, prefix=prefix).params
    try:
        params.validate()
    except InvalidSamplingParams as exc:
        name = FIELD_NAMES.get(exc.field, exc.field).removeprefix("options.")
        raise bad_request(str(exc).replace(exc.field, f"{prefix}{name}", 1), f"{prefix}{name}") from None
