"""One engine request seen from an HTTP handler: validated before any response byte is sent, then
consumed as text deltas, one OutputAssembler per sample (n > 1 is one engine request whose samples
share the computed prompt). Protocol modules only format what this yields.

A stop string ends only its own sample (`abort(rid, index)`); leaving the iteration early (client
gone, handler error) closes the engine stream, which aborts every sample and frees their KV blocks."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from tokenmill.engine import (
    EngineDeadError,
    InvalidSamplingParams,
    OutputAssembler,
    Priority,
    PromptTooLongError,
    RequestError,
    SamplingParams,
    TextDelta,
)
from tokenmill.server.errors import APIError
from tokenmill.server.model_host import ServedModel
from tokenmill.structured import GRAMMAR_FAILED


@dataclass
class Timings:
    start: float = field(default_factory=time.perf_counter)  # request arrival
    submitted: float | None = None
    first_token: float | None = None
    end: float | None = None

    def finish_time(self) -> float:
        # The last chunk is built before the stream closes, i.e. before `end` is set.
        return self.end or time.perf_counter()

    def ollama(self) -> dict[str, int]:
        """Ollama's duration fields, in nanoseconds."""
        end = self.finish_time()
        submitted = self.submitted or end
        first = self.first_token or end

        def ns(seconds: float) -> int:
            return max(0, int(seconds * 1e9))

        return {
            "total_duration": ns(end - self.start),
            "load_duration": ns(submitted - self.start),  # the model is resident: parsing + templating
            "prompt_eval_duration": ns(first - submitted),
            "eval_duration": ns(end - first),
        }


@dataclass
class Result:
    """A finished generation, for non-streaming responses."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    stop_string: str | None = None  # which of the request's stop strings ended it, if one did

    def add(self, d: TextDelta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs or []
        self.top_logprobs += d.top_logprobs or []
        self.finish_reason = d.finish_reason or self.finish_reason
        self.stop_string = d.stop_string or self.stop_string
        self.num_prompt_tokens = d.num_prompt_tokens
        self.num_cached_tokens = d.num_cached_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs


def translate_request_error(exc: Exception, field_names: Mapping[str, str], prompt_field: str) -> APIError:
    """Engine validation errors -> 400s naming the field as the client spelled it."""
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param=prompt_field, code="context_length_exceeded")
    if isinstance(exc, InvalidSamplingParams):
        name = field_names.get(exc.field, exc.field)
        message = str(exc).replace(exc.field, name, 1) if name != exc.field else str(exc)
        return APIError(400, message, param=name)
    return APIError(400, str(exc), param=prompt_field)


class Generation:
    def __init__(self, served: ServedModel, prompt_ids: list[int], params: SamplingParams, *, n: int = 1,
                 priority: Priority = Priority.NORMAL, num_ctx: int | None = None, num_keep: int = 0,
                 truncate: bool = False, shift: bool = False, field_names: Mapping[str, str] | None = None,
                 prompt_field: str = "prompt", timings: Timings | None = None):
        self.served = served
        self.prompt_ids = prompt_ids
        self.params = params
        self.n = n
        self.priority = priority
        self.options = {"num_ctx": num_ctx, "num_keep": num_keep, "truncate": truncate, "shift": shift}
        self.timings = timings or Timings()
        self.request_id = f"req-{uuid.uuid4().hex[:16]}"
        # What the engine reports once it runs: the prompt it computed (shorter when truncated).
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        try:
            # Read-only check on this thread, so bad input is a 400 before a stream's 200 goes out.
            served.engine.check_request(prompt_ids, params, n=n, **self.options)
        except (RequestError, InvalidSamplingParams) as exc:
            raise translate_request_error(exc, field_names or {}, prompt_field) from None

    async def deltas(self) -> AsyncIterator[tuple[int, TextDelta]]:
        """(sample index, delta) until every sample has finished."""
        aengine = self.served.aengine
        assemblers = [OutputAssembler(aengine.engine.tokenizer, self.params) for _ in range(self.n)]
        done = [False] * self.n
        self.timings.submitted = time.perf_counter()
        stream = aengine.generate(self.prompt_ids, self.params, request_id=self.request_id, priority=self.priority,
                                  n=self.n, **self.options)
        try:
            async for ev in stream:
                if done[ev.index]:  # stopped by a stop string: late tokens, then its abort, are dropped
                    continue
                if self.timings.first_token is None and ev.token_ids:
                    self.timings.first_token = time.perf_counter()
                delta = assemblers[ev.index].push(ev)
                self.num_prompt_tokens = delta.num_prompt_tokens
                self.num_cached_tokens = delta.num_cached_tokens
                if delta.finish_reason == "error" and (delta.error or "").startswith(GRAMMAR_FAILED):
                    raise APIError(400, delta.error, code="grammar_failed")  # the client's grammar, not a fault
                if delta.finish_reason == "error":
                    raise APIError(500, f"generation failed: {delta.error or 'engine error'}", code="engine_error")
                if delta.finish_reason == "abort":
                    raise APIError(503, "the request was aborted (the server is shutting down or switching models)",
                                   code="aborted")
                if delta.hit_stop_string:  # only this sample ends; its siblings go on
                    aengine.abort(self.request_id, ev.index)
                done[ev.index] = delta.finished
                yield ev.index, delta
                if all(done):
                    break
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        finally:
            self.timings.end = time.perf_counter()
            await stream.aclose()

    async def collect(self) -> list[Result]:
        """Every sample run to the end, in index order."""
        results = [Result() for _ in range(self.n)]
        async for i, d in self.deltas():
            results[i].add(d)
        return results


async def all_deltas(gens: list[Generation]) -> AsyncIterator[tuple[int, TextDelta]]:
    """The deltas of several generations (one per prompt, n samples each) as (choice, delta), with
    choice = prompt index * n + sample index, in arrival order; the first error stops them all."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0].deltas()) as deltas:
            async for item in deltas:
                yield item
        return
    async with contextlib.aclosing(merge([g.deltas() for g in gens])) as merged:
        async for p, (i, d) in merged:
            yield p * gens[p].n + i, d


async def collect_all(gens: list[Generation]) -> list[Result]:
    """Every sample of every generation run to the end, by choice index."""
    results = [Result() for g in gens for _ in range(g.n)]
    async with contextlib.aclosing(all_deltas(gens)) as deltas:
        async for choice, d in deltas:
            results[choice].add(d)
    return results


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators as (index, item) in arrival order; the first error
    cancels the rest (their engine requests are aborted)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                await queue.put((i, item, None))
        except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, None, exc))
            return
        finally:
            await it.aclose()  # type: ignore[attr-defined]
        await queue.put((i, done, None))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
