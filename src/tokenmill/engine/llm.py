"""Offline use: `LLM(model).generate(prompts, params)` runs the engine in the calling thread."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.output import OutputAssembler
from tokenmill.engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str
    num_cached_tokens: int
    index: int = 0  # which of the prompt's n samples
    # SamplingParams.prompt_logprobs: entry i is prompt token i's (logprob, top alternatives) given the
    # tokens before it; entry 0 is None, as in vLLM's RequestOutput.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None


class LLM:
    def __init__(self, model: str | Path, config: EngineConfig | None = None, *, progress: bool = False):
        from tokenmill.store.names import resolve_named

        # A name, a path, or a created model (`create`, `cp`): its weights here (a blob, adapters merged
        # in); its chat profile is for the chat APIs. A known model not installed is an error, not a pull.
        self.engine = LLMEngine.from_path(resolve_named(str(model)).path, config, progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 *, n: int = 1, **options: Any) -> list[CompletionOutput]:
        """Outputs in prompt order, n per prompt (sample 0..n-1 of the first prompt, then the next).
        options go to add_request: priority, num_ctx, num_keep, truncate, shift."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids_list = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        assemblers: dict[tuple[str, int], OutputAssembler] = {}
        collected: dict[tuple[str, int], CompletionOutput] = {}
        for ids, p in zip(ids_list, params_list):
            rid = self.engine.add_request(ids, p, n=n, **options)
            for i in range(n):
                assemblers[rid, i] = OutputAssembler(self.tokenizer, p)
                collected[rid, i] = CompletionOutput(ids, "", [], [] if p.logprobs or p.top_logprobs else None,
                                                     [] if p.top_logprobs else None, "", 0, i)
        while self.engine.has_unfinished():
            for ev in self.engine.step():
                key = (ev.request_id, ev.index)
                delta = assemblers[key].push(ev)
                out = collected[key]
                out.text += delta.text
                out.token_ids += delta.token_ids
                if out.logprobs is not None and delta.logprobs:
                    out.logprobs += delta.logprobs
                if out.top_logprobs is not None and delta.top_logprobs:
                    out.top_logprobs += delta.top_logprobs
                out.num_cached_tokens = delta.num_cached_tokens
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = [None, *delta.prompt_logprobs]
                if delta.hit_stop_string:  # only this sample stops; its siblings go on
                    self.engine.abort(ev.request_id, ev.index)
                if delta.finished:
                    out.finish_reason = delta.finish_reason
        return list(collected.values())
