"""Per-request sampling parameters, shared by the Ollama and OpenAI front ends.

Defaults are the engine's own; API layers translate their defaults (e.g. Ollama's top_k=40) into
explicit values before building one of these.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.structured import Grammar

MAX_TOP_LOGPROBS = 20
MAX_SPECULATIVE_TOKENS = 16  # proposed tokens per step and sequence (engine/speculative/)
# OpenAI caps temperature at 2 and Ollama not at all; we only reject values that are clearly
# nonsense (and inf/nan), so clients that send e.g. 3.0 keep working.
MAX_TEMPERATURE = 100.0
MAX_REPEAT_PENALTY = 3.4028234663852886e38  # the largest fp32
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: -100 bans a token, 100 all but forces it


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range. `field` names it so API layers can report it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    max_tokens: int | None = 256  # None = until the context is full
    min_tokens: int = 0  # EOS and stop tokens are suppressed until this many tokens are out
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off; 0 keeps only the most likely token (llama.cpp keeps >= 1)
    min_p: float = 0.0  # 0 = off
    typical_p: float = 1.0  # 1 = off
    # llama.cpp style: a seen token's logit becomes logit/p if positive, logit*p otherwise.
    repeat_penalty: float = 1.0
    # Window for all three penalties, counted over prompt + output like llama.cpp (its server
    # feeds the prompt through the sampler history). 0 = penalties off, -1 = whole context.
    repeat_last_n: int = 64
    # OpenAI-style additive penalties, but (following llama.cpp) counted over the same last-n
    # window as repeat_penalty rather than over the generated tokens only.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, matched on the output text
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the sequence
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20 alternatives per position
    # The prompt's own logprobs (OpenAI's echo with logprobs, vLLM's prompt_logprobs): each prompt token
    # after the first, given the ones before it, with this many alternatives; None = not computed.
    # Such a request computes its whole prompt: the prefix cache holds no logits.
    prompt_logprobs: int | None = None
    # The output must match this grammar (compiled off the engine thread, see structured/): tokens it
    # does not allow are masked out, and the sequence ends with `stop` once the grammar is complete.
    constraint: "Grammar | None" = None
    # Speculative decoding (engine/speculative/): True or False overrides the engine's setting for this
    # request; num_speculative_tokens caps the tokens proposed per step (0 = none). Greedy output is the
    # same either way, and so is a seeded request's.
    speculative: bool | None = None
    num_speculative_tokens: int | None = None
    # OpenAI's predicted output (`prediction`): tokens the answer is expected to repeat, which prompt
    # lookup searches as it searches the context (the answer is the model's either way).
    prediction_ids: tuple[int, ...] = ()
    # OpenAI's logit_bias: token id -> a value added to that token's logit before sampling (after the
    # penalties, before the grammar mask), every step; greedy rows take the argmax of the biased logits.
    logit_bias: dict[int, float] | None = None

    @property
    def is_greedy(self) -> bool:
        # top_k=1 is greedy too; taking the argmax path for it skips the sort and the RNG.
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    def validate(self) -> None:
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, lo=1)
        _int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidSamplingParams(
                "min_tokens",
                f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        _num("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _int("top_k", self.top_k, lo=0)
        _num("top_p", self.top_p, 0.0, 1.0)
        _num("min_p", self.min_p, 0.0, 1.0)
        _num("typical_p", self.typical_p, 0.0, 1.0)
        _num("repeat_penalty", self.repeat_penalty, 0.0, math.inf, lo_open=True)
        if self.repeat_penalty > MAX_REPEAT_PENALTY:  # the sampler's penalties are fp32: more would be inf there
            raise InvalidSamplingParams("repeat_penalty", f"repeat_penalty must be at most {MAX_REPEAT_PENALTY:g}, "
                                                          f"got {self.repeat_penalty:g}")
        _int("repeat_last_n", self.repeat_last_n, lo=-1)
        _num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _int("seed", self.seed)
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidSamplingParams("stop", f"stop must be a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidSamplingParams(
                "stop_token_ids", f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, lo=0)
        _int("top_logprobs", self.top_logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise InvalidSamplingParams("speculative", f"speculative must be true or false, got {self.speculative!r}")
        if self.num_speculative_tokens is not None:
            _int("num_speculative_tokens", self.num_speculative_tokens, lo=0, hi=MAX_SPECULATIVE_TOKENS)
        if not isinstance(self.prediction_ids, tuple):
            raise InvalidSamplingParams("prediction", f"prediction_ids must be a tuple of token ids, got "
                                                      f"{type(self.prediction_ids).__name__}")
        for t in self.prediction_ids:
            _int("prediction", t, lo=0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidSamplingParams("logit_bias", f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                _int("logit_bias", token, lo=0)
                _num("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(name: str, v, lo: int | None = None, hi: int | None = None) -> None:
    if not _is_int(v):
        raise InvalidSamplingParams(name, f"{name} must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        if hi is None:
            rng = f"at least {lo}"
        elif lo is None:
            rng = f"at most {hi}"
        else:
            rng = f"between {lo} and {hi}"
        raise InvalidSamplingParams(name, f"{name} must be {rng}, got {v}")


def _num(name: str, v, lo: float, hi: float, lo_open: bool = False) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise InvalidSamplingParams(name, f"{name} must be a number, got {v!r}")
    # Written so that nan fails every comparison and is rejected.
    ok = (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        if math.isinf(hi):
            rng = f"greater than {lo:g}" if lo_open else f"at least {lo:g}"
        else:
            rng = f"between {lo:g} and {hi:g}"
        raise InvalidSamplingParams(name, f"{name} must be {rng}, got {v:g}")
