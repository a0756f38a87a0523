"""The engine: owns the model, the KV cache and the scheduler, and advances every request one step
at a time. Single-threaded by design; `AsyncEngine` (client.py) runs it on a background thread."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tokenmill.cpu_threads import configure_threads
from tokenmill.engine import decode_steps
from tokenmill.engine.config import DEFAULT_DECODE_STEPS, ConfigError, EngineConfig
from tokenmill.engine.context import generation_reserve, truncate_prompt
from tokenmill.engine.device import build_device_runner, fit_device_kv_cache, on_device
from tokenmill.engine.health import StepFaults, StepShape
from tokenmill.engine.prompt_scores import score_prompt_rows
from tokenmill.engine.request import FinishReason, Priority, Sequence
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampler import SampleResult, Sampler, greedy_exclusions
from tokenmill.engine.sampler_input import sampler_input
from tokenmill.engine.sampling_params import InvalidSamplingParams, SamplingParams
from tokenmill.engine.scheduler import ScheduledBatch, Scheduler
from tokenmill.engine.speculative import SpecConfigError
from tokenmill.engine.speculative.build import build_speculator
from tokenmill.engine.stats import HISTOGRAM_NAMES, EngineStats, HistogramSnapshot, StatsSnapshot, StepRecord
from tokenmill.kvcache import BlockManager
from tokenmill.kernels import native
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import LoadedModel, load_model
from tokenmill.model.decode_graph import DecodeGraph
from tokenmill.model.step_graph import MIN_TOKENS, StepGraph
from tokenmill.structured import MaskWorker
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.engine")


class RequestError(ValueError):
    """A request the engine cannot take; the message is meant for the client."""


class CacheFullError(RuntimeError):
    """No room in the KV cache right now (embed); worth retrying once running requests finish."""


class PromptTooLongError(RequestError):
    def __init__(self, num_prompt_tokens: int, limit: int):
        # A prompt that exactly fills the context is refused too: no room is left for a token.
        room = "" if num_prompt_tokens > limit else ", with no room left to generate"
        super().__init__(f"prompt is {num_prompt_tokens} tokens, but the context holds {limit}{room}")
        self.num_prompt_tokens = num_prompt_tokens
        self.limit = limit


@dataclass
class TokenEvent:
    """What one step did for one sample of a request: tokens since the last event, and the ending
    if it ended. A request with n samples gets events for indices 0..n-1, each ending once."""
    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: FinishReason | None
    error: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    index: int = 0  # which sample of the request (parallel sampling, n > 1)
    # SamplingParams.prompt_logprobs: the prompt's scores (Sequence.prompt_scores), on a sample's first event.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def step_runs_natively(loaded: LoadedModel) -> bool:
    """Whether the model's steps run in the compiled core (every weight in GGUF blocks on the native
    kernels), so that torch only runs the glue between its calls; else torch does the work (dense
    bf16/fp32 weights, a GGUF type the kernels lack, or TOKENMILL_NATIVE=0)."""
    model = loaded.model
    return (native.module() is not None and loaded.weights == "gguf"
            and callable(getattr(model, "all_weights_in_blocks", None)) and model.all_weights_in_blocks())


def uses_native_attention(loaded: LoadedModel) -> bool:
    return native.module() is not None and loaded.dtype == torch.float32


def kv_cache_dtype(cfg: EngineConfig, loaded: LoadedModel) -> torch.dtype:
    """auto: f16 for GGUF weights on the native path (half the bytes of float32, and attention
    reads every key each step; llama.cpp's default too: 3 more mantissa bits than bf16, which cut
    the logits' distance to the fp32 model several times in `bench quality`), else the activations'
    dtype. Other caches need native attention."""
    native_attention = uses_native_attention(loaded)
    if cfg.kv_dtype == "auto":
        return torch.float16 if native_attention and loaded.weights == "gguf" else loaded.dtype
    wanted = {"f16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}[cfg.kv_dtype]
    if wanted != loaded.dtype and not native_attention:
        raise ConfigError(f"kv_dtype {cfg.kv_dtype} needs the native kernels with float32 activations "
                          f"(dtype gguf or fp32); this engine runs {loaded.dtype} on {native.variant()}")
    return wanted


class LLMEngine:
    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, cfg: EngineConfig | None = None, *,
                 draft: LoadedModel | None = None):
        cfg = cfg or EngineConfig()
        cfg.validate()
        # Process-wide, shared with every other engine (cpu_threads.configure_threads says how).
        self.threads = configure_threads(cfg.threads, torch_computes=not step_runs_natively(loaded))
        device_model = on_device(loaded)  # a GPU model: its own KV sizing and runner (engine/device.py)
        cfg = cfg.for_device(gpu=device_model)  # step sizes left automatic, for where the model runs
        if device_model:
            cfg = fit_device_kv_cache(cfg, loaded, kv_cache_dtype(cfg, loaded))
        self.cfg = cfg
        log.info("steps of up to %d tokens (%d per model call), %d sequences at once (--batch-size, --ubatch-size, "
                 "--parallel)", cfg.n_batch, cfg.n_ubatch, cfg.parallel)
        self.loaded = loaded
        self.tokenizer = tokenizer
        mc = loaded.config
        # One sequence can never hold more than the whole KV cache: that is its context, and what
        # /v1/models, /api/ps and /props report (llama.cpp's n_ctx is the cache's size too).
        context = cfg.context_limit(mc.context_length)
        self.max_model_len = min(context, cfg.num_blocks * cfg.block_size)
        loaded.model.fit_context(self.max_model_len)  # before the first step takes the rotary tables' addresses
        if self.max_model_len < context:
            log.warning("the KV cache holds %d tokens (kv_size or the memory left for it), less than the %d-token "
                        "context: a request's prompt and output get at most %d", self.max_model_len, context,
                        self.max_model_len)
        # Bounded work: no request generates more than this, whatever it asks (context shift would
        # otherwise let a request without max_tokens run forever).
        self.max_new_tokens = cfg.max_new_tokens or mc.context_length
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
        # Every row through the native paged attention: float32 activations with the compiled core.
        self.native_attention = uses_native_attention(loaded)
        self.kv = KVStorage(mc.n_layers, cfg.num_blocks, cfg.block_size, mc.n_kv_heads, mc.head_dim,
                            kv_cache_dtype(cfg, loaded), lazy=self.native_attention, device=loaded.device)
        self.scheduler = Scheduler(cfg, self.blocks, tokenizer.stop_ids)
        decode_graph = step_graph = None
        if cfg.compile and self.native_attention:
            log.info("native kernels (%s): model steps run eagerly, nothing to compile", native.variant())
        elif cfg.compile and not device_model:
            # Before any request: the warm-up batches write into the first blocks.
            try:
                decode_graph = DecodeGraph(loaded.model, self.kv.k, self.kv.v, cfg.block_size)
                decode_graph.warmup()
                if cfg.n_ubatch >= MIN_TOKENS:
                    step_graph = StepGraph(loaded.model, self.kv.k, self.kv.v, cfg.block_size, cfg.n_ubatch)
                    step_graph.warmup()
            except Exception as exc:  # noqa: BLE001 - e.g. no C++ compiler: serve eagerly rather than not at all
                log.warning("compiling the model failed, running it eagerly: %s: %s", type(exc).__name__, exc)
                decode_graph = step_graph = None
        if device_model:
            self.runner = build_device_runner(loaded, self.kv, self.blocks, cfg, self.max_model_len)
        else:
            self.runner = ModelRunner(loaded.model, self.kv, self.blocks, cfg.n_ubatch, decode_graph, step_graph,
                                      native_attention=self.native_attention)
        self.sampler = Sampler()
        # Decode steps in a row, where the runner can run them (engine/decode_steps.py): the device one.
        can_run_steps = getattr(self.runner, "supports_decode_steps", False)
        self.decode_steps = (cfg.decode_steps or DEFAULT_DECODE_STEPS) if can_run_steps else 1
        if self.decode_steps > 1:
            log.info("decode steps: up to %d in a row on %s for batches that need nothing from the host "
                     "between tokens (--decode-steps)", self.decode_steps, self.kv.device)
        self.masks = MaskWorker()
        self.stats = EngineStats()
        # Speculative decoding (engine/speculative/) where a proposed row computes exactly as it would
        # in a step of its own (the native kernels' batch invariance): greedy output stays the same.
        spec = cfg.spec_config()
        if getattr(self.runner, "supports_drafts", False) and self.native_attention and step_runs_natively(loaded):
            try:
                self.scheduler.speculator = build_speculator(
                    spec, loaded, num_blocks=cfg.num_blocks, block_size=cfg.block_size, n_ubatch=cfg.n_ubatch,
                    kv_dtype=self.kv.dtype, counters=self.stats.spec, draft=draft)
            except SpecConfigError as exc:
                raise ConfigError(str(exc)) from None
        elif spec.method == "draft":
            raise ConfigError("speculative draft:MODEL needs the model on the CPU's native kernels (GGUF weights, "
                              "float32 activations), where a step's rows compute independently")
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.faults = StepFaults()
        self.current_step: StepShape | None = None  # read by the watchdog thread
        # Test hook: called with the batch inside the step's fault boundary, just before the model
        # runs. Tests make it raise (fault injection) or sleep (a slow or hung step).
        self.step_hook: Callable[[ScheduledBatch], None] | None = None

    @classmethod
    def from_path(cls, path: str | Path, cfg: EngineConfig | None = None, *, progress: bool = False) -> "LLMEngine":
        cfg = cfg or EngineConfig()
        loaded = load_model(path, cfg.dtype, progress=progress, device=cfg.device)
        return cls(loaded, Tokenizer.from_gguf_metadata(loaded.gguf.metadata), cfg)

    # --- requests ------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams, num_ctx: int | None = None, *,
                      n: int = 1, num_keep: int = 0, truncate: bool = False, shift: bool = False) -> int:
        """Validate without side effects; returns the sequence's context limit. With truncate, a
        prompt longer than the context is accepted (add_request cuts it)."""
        params.validate()
        if not prompt_ids:
            raise RequestError("prompt is empty")
        if n < 1:
            raise RequestError(f"n must be at least 1, got {n}")
        if num_keep < 0:
            raise RequestError(f"num_keep must be >= 0, got {num_keep}")
        if num_ctx is not None and num_ctx < 2:
            raise RequestError(f"num_ctx must be at least 2, got {num_ctx}")
        limit = self.max_model_len if num_ctx is None else min(num_ctx, self.max_model_len)
        if len(prompt_ids) >= limit and not truncate:
            raise PromptTooLongError(len(prompt_ids), limit)
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if params.prediction_ids and max(params.prediction_ids) >= vocab:
            raise InvalidSamplingParams("prediction", f"prediction holds token id {max(params.prediction_ids)}, "
                                        f"outside the vocabulary (0..{vocab - 1})")
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise InvalidSamplingParams("logit_bias", f"logit_bias names token id {bad}, outside the vocabulary "
                                        f"(0..{vocab - 1})")
        if params.constraint is not None and params.constraint.vocab_size != self.tokenizer.vocab_size:
            raise RequestError("the grammar was compiled for another model's vocabulary")
        return limit

    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    priority: Priority = Priority.NORMAL, num_ctx: int | None = None, n: int = 1,
                    num_keep: int = 0, truncate: bool = False, shift: bool = False) -> str:
        """Queue a request. n: parallel samples sharing one computed prompt (events carry `index`).
        num_ctx: this request's context (capped by the engine's). truncate: cut a prompt that does not
        fit to its first num_keep tokens plus the newest tail instead of rejecting it. shift: when the
        context fills up during generation, drop the older half after num_keep and go on, instead of
        finishing with `length`."""
        limit = self.check_request(prompt_ids, params, num_ctx, n=n, num_keep=num_keep, truncate=truncate,
                                   shift=shift)
        request_id = request_id or f"req-{next(self._request_ids)}"
        prompt_ids = list(prompt_ids)
        if len(prompt_ids) >= limit:  # truncate was asked, or check_request would have raised
            cut = truncate_prompt(prompt_ids, limit, num_keep, generation_reserve(limit, params.max_tokens))
            log.info("request %s: prompt of %d tokens truncated to %d for a %d-token context "
                     "(kept the first %d, dropped the %d after them)", request_id, len(prompt_ids),
                     len(cut.token_ids), limit, cut.num_keep, cut.num_dropped)
            prompt_ids = cut.token_ids
        if params.max_tokens is None or params.max_tokens > self.max_new_tokens:
            params = replace(params, max_tokens=self.max_new_tokens)
        seq = Sequence(next(self._seq_ids), request_id, prompt_ids, params, limit, priority,
                       num_pending_forks=n - 1, num_keep=min(num_keep, limit - 2), shift=shift)
        if self.cfg.request_timeout > 0:
            seq.deadline = seq.times.arrival + self.cfg.request_timeout
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str, index: int | None = None) -> list[TokenEvent]:
        """Finish a request's samples (or only sample `index`, e.g. one that hit a stop string). A sample
        not yet forked from the sequence computing the prompt ends at once, and its siblings go on."""
        events = []
        for seq in self.scheduler.find(request_id):
            if index is None or (seq.sample_index == index and not seq.unforked_samples()):
                self.scheduler.finish(seq, FinishReason.ABORT)
                events += self._finished(seq)
            elif seq.sample_index == index:
                events.append(self._unforked_end(seq, index, FinishReason.ABORT))
                seq.hand_over()
            elif index in seq.unforked_samples():
                seq.aborted_forks.add(index)
                events.append(self._unforked_end(seq, index, FinishReason.ABORT))
        return events

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def ready_to_step(self, now: float | None = None) -> bool:
        return self.step_delay(now) == 0.0

    def step_delay(self, now: float | None = None) -> float:
        """Seconds to hold off the next step so a burst of arrivals starts as one batch (max_wait_ms):
        0 when running work must go on, a full batch waits, or the oldest waited long enough."""
        sched = self.scheduler
        if self.cfg.max_wait_ms <= 0 or sched.running or len(sched.waiting) >= self.cfg.parallel:
            return 0.0
        oldest = sched.waiting.oldest_arrival()
        if oldest is None:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, oldest + self.cfg.max_wait_ms / 1000.0 - now)

    # --- the loop ------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        start = time.perf_counter()
        preemptions_before = self.scheduler.num_preemptions
        events = self._expire_overdue()
        batch = self.scheduler.schedule()
        events += [ev for seq in batch.finished for ev in self._finished(seq)]
        if not batch.chunks:
            return events
        shape = self.current_step = StepShape.of(batch)
        try:
            if self.step_hook is not None:
                self.step_hook(batch)
            steps = self._decode_steps(batch)
            model_start = time.perf_counter()
            if steps > 1:  # several steps in a row on the device (engine/decode_steps.py)
                results = decode_steps.run_model(batch, steps, self.runner, self.sampler, self.scheduler.stop_ids)
            else:
                result = self._model_step(batch)
            model_seconds = time.perf_counter() - model_start
        except Exception as exc:  # noqa: BLE001 - one bad step must not take the server down
            log.exception("step failed; finishing its %d sequences with an error", len(batch.chunks))
            message = f"{type(exc).__name__}: {exc}"
            self.faults.record_failure(message)
            return events + self._fail(batch, message)
        finally:
            self.current_step = None
        self.faults.record_success()
        if steps > 1:
            changed = self.scheduler.update_decode_steps(batch, results)
        else:
            changed = self.scheduler.update(batch, result)
        self._record(shape, start, self.scheduler.num_preemptions - preemptions_before, batch.num_cached_tokens)
        if self.scheduler.speculator is not None and steps == 1:
            self.scheduler.speculator.observe_step(batch.num_tokens, model_seconds, time.perf_counter() - start,
                                                   has_prefill=shape.num_prefill_tokens > 0)
        for seq in changed:
            self.stats.record_token(seq, len(seq.output_ids) - seq.num_emitted)
            events += self._finished(seq) if seq.is_finished else [self._event(seq)]
        return events

    def _model_step(self, batch: ScheduledBatch) -> SampleResult | None:
        """One ordinary step's model call and sampling: the SampleResult (None when no row samples)."""
        # Grammar masks are built on a worker thread while the model runs.
        masks = self.masks.start([(c.seq.seq_id, c.seq.constraint) for c in batch.sampling_chunks
                                  if c.seq.constraint is not None]
                                 + [state for c in batch.sampling_chunks for state in c.mask_states()])
        self.kv.copy_blocks(batch.copies)  # copy-on-write: private copies before anyone writes
        exclude = self._greedy_exclusions(batch)
        out = self.runner.run(batch, greedy_tokens=True, exclude=exclude) if exclude is not None else self.runner.run(batch)
        logits = out.logits
        if out.prompt_rows:
            score_prompt_rows(self.runner.model, out.prompt_rows)
        if masks is not None:
            masks.wait()  # forking copies a parent's matcher, which the worker may still be reading
        self.scheduler.fork_samples(batch, lambda: next(self._seq_ids))
        if out.tokens is not None:  # a forked sample's token is its parent's row's
            return SampleResult(token_ids=self._logits(out.tokens, batch).tolist())
        if logits is None:
            return None
        inp = sampler_input(batch, self.scheduler.stop_ids, masks)
        return self.sampler(self._logits(logits, batch), inp, owned=True)

    def _greedy_exclusions(self, batch: ScheduledBatch) -> tuple[int, ...] | None:
        """The ids every sampling row of the step suppresses (() for none) when each takes its logits'
        argmax once they are suppressed and nothing else (sampler.py's greedy_exclusions, no grammar),
        all rows the same ids, and the runner can give tokens for them (DecoderLM.greedy_tokens: the
        head need not write its logits); None otherwise."""
        chunks = batch.sampling_chunks
        if not chunks or not getattr(self.runner, "picks_greedy_tokens", False):
            return None
        vocab = self.runner.model.config.vocab_size
        found: set[tuple[int, ...] | None] = set()
        for c in chunks:
            if c.seq.constraint is not None:
                return None
            # A verifying sequence's rows count the proposals before each (sampler_input.py). A row's
            # exclusions change with that count only where it crosses min_tokens, so the first and the
            # last row say what all of them do.
            first = len(c.seq.output_ids)
            for n in (first, first + c.num_sample_rows - 1):
                found.add(greedy_exclusions(c.seq.params, n, self.scheduler.stop_ids, vocab))
                if None in found or len(found) > 1:
                    return None
        return found.pop()

    def _decode_steps(self, batch: ScheduledBatch) -> int:
        """How many decode steps this batch runs in a row (1: an ordinary step), its blocks reserved."""
        if self.decode_steps < 2:
            return 1
        steps = decode_steps.steps_for(batch, self.scheduler, self.decode_steps)
        return steps if steps > 1 and self.scheduler.reserve_decode_steps(batch, steps) else 1

    @staticmethod
    def _logits(logits: torch.Tensor, batch: ScheduledBatch) -> torch.Tensor:
        # Forked samples reuse their parent's row (of logits, or of greedy tokens): the prompt was
        # computed once, for all of them.
        rows = batch.logit_rows()
        return logits if rows is None else logits.index_select(0, torch.tensor(rows, device=logits.device))

    def _fail(self, batch: ScheduledBatch, message: str) -> list[TokenEvent]:
        events = []
        for chunk in batch.chunks:
            if not chunk.seq.is_finished:
                self.scheduler.finish(chunk.seq, FinishReason.ERROR, message)
                events += self._finished(chunk.seq)
        return events

    def _expire_overdue(self) -> list[TokenEvent]:
        """Finish the sequences whose deadline (request_timeout) has passed, running or waiting."""
        if self.cfg.request_timeout <= 0:
            return []
        events = []
        for seq in self.scheduler.overdue(time.monotonic()):
            log.info("request %s sample %d: deadline of %gs reached after %d tokens; finishing it",
                     seq.request_id, seq.sample_index, self.cfg.request_timeout, len(seq.output_ids))
            self.scheduler.finish(seq, FinishReason.TIMEOUT, f"request timeout ({self.cfg.request_timeout:g}s)")
            events += self._finished(seq)
        return events

    def _finished(self, seq: Sequence) -> list[TokenEvent]:
        """The final event of a sequence, plus one for each sample it never got to fork (the request
        ended before its prompt was computed), so a client counting n endings is not left waiting."""
        self.stats.record_finish(seq)
        events = [self._event(seq)]
        events += [self._unforked_end(seq, i, seq.finish_reason, seq.error) for i in seq.unforked_samples()]
        seq.num_pending_forks = 0
        seq.aborted_forks.clear()
        return events

    @staticmethod
    def _unforked_end(seq: Sequence, index: int, reason: FinishReason | None, error: str | None = None) -> TokenEvent:
        """The final event of sample `index`, never forked from seq: no tokens."""
        return TokenEvent(seq.request_id, [], None, None, reason, error, len(seq.prompt_ids),
                          seq.num_cached_prompt_tokens, 0, index)

    def _record(self, shape: StepShape, start: float, preemptions: int, cached_tokens: int) -> None:
        # The shape counted at the step's start: the forks made after the model call add chunks that
        # compute nothing (neither decodes nor prefill tokens).
        self.stats.num_preemptions += preemptions
        self.stats.record_step(StepRecord(shape.num_tokens, shape.num_seqs, shape.num_decodes,
                                          shape.num_prefill_tokens, time.perf_counter() - start, cached_tokens))

    def _event(self, seq: Sequence) -> TokenEvent:
        new = seq.output_ids[seq.num_emitted:]
        logprobs = seq.output_logprobs[seq.num_emitted:] if seq.params.logprobs or seq.params.top_logprobs else None
        top = seq.output_top_logprobs[seq.num_emitted:] if seq.params.top_logprobs else None
        first = seq.params.prompt_logprobs is not None and seq.num_emitted == 0
        seq.num_emitted = len(seq.output_ids)
        return TokenEvent(seq.request_id, new, logprobs, top, seq.finish_reason, seq.error,
                          len(seq.prompt_ids), seq.num_cached_prompt_tokens, len(seq.output_ids), seq.sample_index,
                          list(seq.prompt_scores) if first else None)

    # --- embeddings ----------------------------------------------------------------------------
    def embed(self, prompt_ids: list[int]) -> list[float]:
        """Mean-pooled, L2-normalised final hidden states of one forward pass over prompt_ids (what
        Ollama returns for a model without its own pooling). Uses a temporary sequence's blocks,
        freed before returning; call between steps (on the loop thread, via AsyncEngine.call)."""
        n = len(prompt_ids)
        if not n:
            raise RequestError("input is empty")
        seq_id = next(self._seq_ids)
        if not self.blocks.can_allocate(seq_id, n):
            raise CacheFullError(f"no room in the KV cache for {n} tokens right now")
        self.blocks.allocate(seq_id, n)
        try:
            table = self.blocks.block_table(seq_id)
            model = self.loaded.model
            total = None
            with torch.inference_mode():
                # In micro-batches like the runner, so a long input never builds one huge attention.
                for start in range(0, n, self.cfg.n_ubatch):
                    end = min(n, start + self.cfg.n_ubatch)
                    hidden = self.runner.hidden_states(prompt_ids[start:end], start, table)
                    part = model.final_hidden(hidden).float().sum(dim=0)
                    total = part if total is None else total + part
            return torch.nn.functional.normalize(total / n, dim=0).tolist()
        finally:
            self.blocks.free(seq_id)

    # --- introspection -------------------------------------------------------------------------
    def stats_snapshot(self) -> StatsSnapshot:
        """Queue, cache and counter numbers of one moment (take it between steps to be consistent)."""
        s = self.stats
        prefix = self.blocks.prefix_stats()
        with s.lock:
            return StatsSnapshot(
                self.num_running(), self.num_waiting(), self.kv_usage(), self.blocks.num_used_blocks,
                prefix.queries, prefix.hits, s.num_preemptions, s.num_prompt_tokens, s.num_cached_prompt_tokens,
                s.num_generation_tokens, s.num_steps, dict(s.finished),
                {name: HistogramSnapshot.of(getattr(s, name)) for name in HISTOGRAM_NAMES},
                s.spec.num_drafts, s.spec.num_draft_tokens, s.spec.num_accepted_tokens,
                tuple(s.spec.accepted_per_position))

    def kv_usage(self) -> float:
        return self.blocks.usage()

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)
