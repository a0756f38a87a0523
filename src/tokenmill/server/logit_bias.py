"""Reading a request's logit_bias, in the two shapes clients send: OpenAI's object of token ids (JSON
keys, so strings of digits) to numbers in [-100, 100], and llama-server's list of [token, value] pairs,
where the token may be a string (each of its tokens gets the value) and the value `false` bans it. Ids
past the vocabulary are the engine's 400 (it knows the model's)."""
from __future__ import annotations

from collections.abc import Callable

from tokenmill.engine.sampling_params import MAX_LOGIT_BIAS
from tokenmill.server.errors import bad_request, shown_value

FIELD = "logit_bias"
MAX_ENTRIES = 4096  # more biased tokens than any client needs; each costs the sampler work every step


def _value(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"logit_bias values must be numbers, got {shown_value(value)}", FIELD)
    if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # an int of any size compares; nan never passes
        raise bad_request(f"logit_bias values must be between -100 and 100, got {shown_value(value)}", FIELD)
    return float(value)


def _token_id(key: object) -> int:
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12:
        return int(key)
    raise bad_request(f"logit_bias keys must be token ids, got {shown_value(key)}", FIELD)


def openai_logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's form; {} and null are none (SDKs send {})."""
    bias = body.get(FIELD)
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad_request(f"logit_bias must be an object of token ids to numbers, got {shown_value(bias)}", FIELD)
    if len(bias) > MAX_ENTRIES:
        raise bad_request(f"logit_bias may name at most {MAX_ENTRIES} tokens, got {len(bias)}", FIELD)
    return {_token_id(k): _value(v) for k, v in bias.items()} or None


def runner_logit_bias(body: dict, encode: Callable[[str], list[int]]) -> dict[int, float] | None:
    """llama-server's /completion: OpenAI's object, or a list of [token id or string, number or false]
    (false: never produced; here -100, which no logit survives in practice)."""
    bias = body.get(FIELD)
    if not isinstance(bias, list):
        return openai_logit_bias(body)
    out: dict[int, float] = {}
    for pair in bias:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise bad_request(f"logit_bias entries must be [token, value] pairs, got {shown_value(pair)}", FIELD)
        token, value = pair
        value = -MAX_LOGIT_BIAS if value is False else _value(value)
        ids = encode(token) if isinstance(token, str) else [_token_id(token)]
        for t in ids:
            out[t] = value
        if len(out) > MAX_ENTRIES:
            raise bad_request(f"logit_bias may name at most {MAX_ENTRIES} tokens", FIELD)
    return out or None
