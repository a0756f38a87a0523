"""Offline use: `LLM(model).generate(prompts, params)` runs the engine in the calling thread."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


class LLM:
    def __init__(self, model: str | Path, config: EngineConfig | None = None, *, progress: bool = False):
        from tokenmill.store import resolve_model

        self.engine = LLMEngine.from_path(resolve_model(str(model)), config, progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids_list = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        assemblers: dict[str, OutputAssembler] = {}
        collected: dict[str, CompletionOutput] = {}
        order = []
        for ids, p in zip(ids_list, params_list):
            rid = self.engine.add_request(ids, p)
            assemblers[rid] = OutputAssembler(self.tokenizer, p)
            collected[rid] = CompletionOutput(ids, "", [], [] if p.logprobs or p.top_logprobs else None,
                                              [] if p.top_logprobs else None, "", 0)
            order.append(rid)
        while self.engine.has_unfinished():
            for ev in self.engine.step():
                delta = assemblers[ev.request_id].push(ev)
                out = collected[ev.request_id]
                out.text += delta.text
                out.token_ids += delta.token_ids
                if out.logprobs is not None and delta.logprobs:
                    out.logprobs += delta.logprobs
                if out.top_logprobs is not None and delta.top_logprobs:
                    out.top_logprobs += delta.top_logprobs
                out.num_cached_tokens = delta.num_cached_tokens
                if delta.hit_stop_string:
                    self.engine.abort(ev.request_id)
                if delta.finished:
                    out.finish_reason = delta.finish_reason
        return [collected[r] for r in order]
