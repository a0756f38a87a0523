"""The output side of one request, outside the hot loop: incremental detokenization (never half a
UTF-8 character), stop strings with partial-match holdback, and logprobs kept aligned with the text
that is actually sent."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.engine import TokenEvent
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.stop import StopStringMatcher, TokenTextTracker
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]                      # tokens released with this delta (aligned with logprobs)
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None                 # "stop" | "length" | "abort" | "error" once finished
    error: str | None
    hit_stop_string: bool                     # the caller must abort the engine request
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # on the first delta only
    stop_string: str | None = None            # with hit_stop_string: which of the request's stop strings

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputAssembler:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, *, skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stops = StopStringMatcher(params.stop)
        self.tracker = TokenTextTracker()
        self.want_logprobs = params.logprobs or params.top_logprobs > 0
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._top: list[list[tuple[int, float]]] = []
        self._num_released = 0
        self.text = ""  # everything sent so far
        self.finish_reason: str | None = None

    def push(self, ev: TokenEvent) -> TextDelta:
        if self.finish_reason is not None:  # stopped by a stop string: late tokens are dropped
            return self._delta("", ev, hit=False)
        pieces = []
        for i, tok in enumerate(ev.token_ids):
            piece = self.detok.push(tok)
            self.tracker.add(piece)
            pieces.append(piece)
            self._token_ids.append(tok)
            if ev.logprobs is not None:
                self._logprobs.append(ev.logprobs[i])
            if ev.top_logprobs is not None:
                self._top.append(ev.top_logprobs[i])
        text = "".join(pieces)
        if ev.finished:
            text += self.detok.flush()
        result = self.stops.push(text)
        out = result.emit
        if result.stopped:
            self.finish_reason = "stop"
            hit = True
        else:
            hit = False
            if ev.finished:
                out += self.stops.flush()
                self.finish_reason = ev.finish_reason.client_value
        self.text += out
        return self._delta(out, ev, hit)

    def _num_output_tokens(self, ev: TokenEvent) -> int:
        """The generation's token count: once a stop string cut it, the tokens up to the one that
        completed it, as if generation had stopped there (a step that accepted several speculative
        tokens may have delivered more)."""
        if not self.stops.stopped or self.stops.stop_string is None:
            return ev.num_output_tokens
        end = self.stops.emitted_chars + len(self.stops.stop_string)
        return min(ev.num_output_tokens, self.tracker.tokens_before(end))

    def _delta(self, text: str, ev: TokenEvent, hit: bool) -> TextDelta:
        # Release the tokens whose text has been sent; at the cut of a stop string that is final,
        # and a normal finish releases everything.
        if self.finish_reason is not None and not self.stops.stopped:
            upto = len(self._token_ids)
        else:
            upto = self.tracker.tokens_before(self.stops.emitted_chars)
        start, self._num_released = self._num_released, max(self._num_released, upto)
        ids = self._token_ids[start:self._num_released]
        return TextDelta(
            text=text,
            token_ids=ids,
            logprobs=self._logprobs[start:self._num_released] if self.want_logprobs else None,
            top_logprobs=self._top[start:self._num_released] if self._top else None,
            finish_reason=self.finish_reason,
            error=ev.error,
            hit_stop_string=hit,
            num_prompt_tokens=ev.num_prompt_tokens,
            num_cached_tokens=ev.num_cached_tokens,
            num_output_tokens=self._num_output_tokens(ev),
            prompt_logprobs=ev.prompt_logprobs,
            stop_string=self.stops.stop_string if hit else None,
        )
