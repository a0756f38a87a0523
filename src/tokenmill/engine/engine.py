"""The engine: owns the model, the KV cache and the scheduler, and advances every request one step
at a time. Single-threaded by design; `AsyncEngine` (client.py) runs it on a background thread."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.request import FinishReason, Priority, Sequence
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampler import Sampler, SamplerInput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.scheduler import ScheduledBatch, Scheduler
from tokenmill.engine.stats import EngineStats, StepRecord
from tokenmill.kvcache import BlockManager
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import LoadedModel, load_model
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.engine")


class RequestError(ValueError):
    """A request the engine cannot take; the message is meant for the client."""


class PromptTooLongError(RequestError):
    def __init__(self, num_prompt_tokens: int, limit: int):
        super().__init__(f"prompt is {num_prompt_tokens} tokens, but the context holds {limit}")
        self.num_prompt_tokens = num_prompt_tokens
        self.limit = limit


@dataclass
class TokenEvent:
    """What one step did for one request: tokens since the last event, and the ending if it ended."""
    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: FinishReason | None
    error: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, cfg: EngineConfig | None = None):
        cfg = cfg or EngineConfig()
        cfg.validate()
        self.cfg = cfg
        self.loaded = loaded
        self.tokenizer = tokenizer
        mc = loaded.config
        self.max_model_len = min(cfg.max_model_len or mc.context_length, mc.context_length)
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
        self.kv = KVStorage(mc.n_layers, cfg.num_blocks, cfg.block_size, mc.n_kv_heads, mc.head_dim, loaded.dtype)
        self.scheduler = Scheduler(cfg, self.blocks, tokenizer.stop_ids)
        self.runner = ModelRunner(loaded.model, self.kv, self.blocks, cfg.n_ubatch)
        self.sampler = Sampler()
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    @classmethod
    def from_path(cls, path: str | Path, cfg: EngineConfig | None = None, *, progress: bool = False) -> "LLMEngine":
        cfg = cfg or EngineConfig()
        loaded = load_model(path, cfg.dtype, progress=progress)
        return cls(loaded, Tokenizer.from_gguf_metadata(loaded.gguf.metadata), cfg)

    # --- requests ------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams, num_ctx: int | None = None) -> int:
        """Validate without side effects; returns the sequence's context limit."""
        params.validate()
        if not prompt_ids:
            raise RequestError("prompt is empty")
        limit = self.max_model_len if num_ctx is None else min(num_ctx, self.max_model_len)
        limit = min(limit, self.cfg.num_blocks * self.cfg.block_size)
        if len(prompt_ids) >= limit:
            raise PromptTooLongError(len(prompt_ids), limit)
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        return limit

    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    priority: Priority = Priority.NORMAL, num_ctx: int | None = None) -> str:
        limit = self.check_request(prompt_ids, params, num_ctx)
        request_id = request_id or f"req-{next(self._request_ids)}"
        seq = Sequence(next(self._seq_ids), request_id, list(prompt_ids), params, limit, priority)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> list[TokenEvent]:
        events = []
        for seq in self.scheduler.find(request_id):
            self.scheduler.finish(seq, FinishReason.ABORT)
            self.stats.record_finish(seq)
            events.append(self._event(seq))
        return events

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # --- the loop ------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        start = time.perf_counter()
        preemptions_before = self.scheduler.num_preemptions
        batch = self.scheduler.schedule()
        events = [self._finished(seq) for seq in batch.finished]
        if not batch.chunks:
            return events
        try:
            logits = self.runner.run(batch)
            result = None if logits is None else self.sampler(logits, self._sampler_input(batch))
        except Exception as exc:  # noqa: BLE001 - one bad step must not take the server down
            log.exception("step failed; finishing its %d sequences with an error", len(batch.chunks))
            return events + self._fail(batch, f"{type(exc).__name__}: {exc}")
        changed = self.scheduler.update(batch, result)
        self._record(batch, start, self.scheduler.num_preemptions - preemptions_before)
        for seq in changed:
            self.stats.record_token(seq)
            events.append(self._finished(seq) if seq.is_finished else self._event(seq))
        return events

    def _sampler_input(self, batch: ScheduledBatch) -> SamplerInput:
        seqs = [c.seq for c in batch.sampling_chunks]
        params = [s.params for s in seqs]
        recent = []
        if any(p.uses_penalties for p in params):
            for s in seqs:
                n = s.params.repeat_last_n
                ids = s.all_token_ids
                recent.append(ids if n < 0 else ids[-n:] if n else [])
        return SamplerInput(
            params=params,
            generators=[s.generator for s in seqs],
            recent_token_ids=recent,
            num_output_tokens=[len(s.output_ids) for s in seqs],
            stop_token_ids=[self.scheduler.stop_ids] * len(seqs),
        )

    def _fail(self, batch: ScheduledBatch, message: str) -> list[TokenEvent]:
        events = []
        for chunk in batch.chunks:
            if not chunk.seq.is_finished:
                self.scheduler.finish(chunk.seq, FinishReason.ERROR, message)
                events.append(self._finished(chunk.seq))
        return events

    def _finished(self, seq: Sequence) -> TokenEvent:
        self.stats.record_finish(seq)
        return self._event(seq)

    def _record(self, batch: ScheduledBatch, start: float, preemptions: int) -> None:
        decodes = sum(1 for c in batch.chunks if not c.seq.is_prefilling and c.num_new == 1)
        prefill_tokens = sum(c.num_new for c in batch.chunks) - decodes
        self.stats.num_preemptions += preemptions
        self.stats.record_step(StepRecord(batch.num_tokens, len(batch.chunks), decodes, prefill_tokens,
                                          time.perf_counter() - start))

    def _event(self, seq: Sequence) -> TokenEvent:
        new = seq.output_ids[seq.num_emitted:]
        logprobs = seq.output_logprobs[seq.num_emitted:] if seq.params.logprobs or seq.params.top_logprobs else None
        top = seq.output_top_logprobs[seq.num_emitted:] if seq.params.top_logprobs else None
        seq.num_emitted = len(seq.output_ids)
        return TokenEvent(seq.request_id, new, logprobs, top, seq.finish_reason, seq.error,
                          len(seq.prompt_ids), seq.num_cached_prompt_tokens, len(seq.output_ids))

    # --- introspection -------------------------------------------------------------------------
    def kv_usage(self) -> float:
        return self.blocks.usage()

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)
