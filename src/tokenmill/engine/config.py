"""Engine settings: one dataclass, validated once."""
from __future__ import annotations

from dataclasses import dataclass, replace

from tokenmill.engine.speculative.config import SpecConfig, SpecConfigError

POLICIES = ("fifo", "priority", "sjf")
KV_DTYPES = ("auto", "f16", "bf16", "int8")
DEVICES = ("auto", "cpu", "cuda")
# Tokens per KV block. A block holds a head's keys contiguously, and the blocks of a sequence lie
# wherever the free list put them: 64 keys make an 8 KB run for SmolLM2 (head dim 64, f16), where 16
# made 2 KB runs that the decode kernel read at 58-64% of memory speed against 82-83% (64 sequences x 4k,
# bench/paged_attention.py --block-size). vLLM's CPU backend defaults to 128 for the same reason.
# The cost: prefixes are shared in whole blocks, and a sequence's last block is partly empty.
DEFAULT_BLOCK_SIZE = 64
# Decode steps in a row on a GPU (engine/decode_steps.py): 4 pays the host's share of a step once per
# 4 tokens, and a request arriving meanwhile waits at most 3 steps more for its prompt to start.
DEFAULT_DECODE_STEPS = 4


@dataclass(frozen=True)
class StepSizes:
    n_batch: int   # token budget of one step
    n_ubatch: int  # most tokens one model call takes
    parallel: int  # most sequences running at once


# What n_batch, n_ubatch and parallel left at 0 (automatic) become, by where the model runs. On a CPU a
# step of 512 tokens already keeps every core busy (a bigger one only holds running decodes longer behind
# a prompt), and 64 sequences fill its matmuls' rows. A GPU step costs little more for many more rows:
# 8192 tokens (vLLM's budget for its OpenAI server on large GPUs) prefill 64 prompts of 100 tokens in one
# step instead of 13, and 256 sequences decode together (the GPU check's 256-request burst; with 64, a
# server ran them 64 at a time).
CPU_STEP_SIZES = StepSizes(n_batch=512, n_ubatch=512, parallel=64)
GPU_STEP_SIZES = StepSizes(n_batch=8192, n_ubatch=8192, parallel=256)


class ConfigError(ValueError):
    pass


@dataclass
class EngineConfig:
    dtype: str = "auto"                # model/registry.py MODES: auto, gguf, bf16, fp32
    kv_dtype: str = "auto"             # auto, f16, bf16, int8 (f16 and int8 need the native attention path)
    block_size: int = DEFAULT_BLOCK_SIZE
    max_total_tokens: int = 65536      # KV budget in tokens, across all sequences
    max_model_len: int | None = None   # per-sequence context (num_ctx); None = the model's own
    max_sequence_length: int | None = None  # another cap on the same thing; the smaller one wins
    # 0 = automatic for the next three (CPU_STEP_SIZES / GPU_STEP_SIZES; the engine keeps the resolved
    # config, for_device()).
    n_batch: int = 0                   # token budget of one step, shared by decodes and prefill chunks
    n_ubatch: int = 0                  # most tokens one model call processes (micro-batch)
    parallel: int = 0                  # most sequences running at once
    enable_prefix_caching: bool = True
    # Waiting-queue order (engine/policy.py): "fifo" by arrival; "priority" by request priority, then
    # arrival, preempting lower-priority running work when a higher one cannot be admitted;
    # "sjf" shortest expected job first, with ageing.
    policy: str = "fifo"
    aging_ms: float = 10.0             # sjf: each aging_ms of waiting counts as one token less of work
    # Hold a step back while fewer than `parallel` requests wait and the oldest has waited less than
    # this, so a burst of arrivals starts as one batch. 0 = never hold back. Only idle engines wait.
    max_wait_ms: float = 0.0
    threads: int = 0                   # compute threads, process-wide (cpu_threads.py); 0 = physical cores
    # Model steps through torch.compile'd graphs (model/decode_graph.py, model/step_graph.py),
    # compiled when the engine is built. Off by default here so library users and tests do not pay
    # the compile; the CLI's default (config.py) is on.
    compile: bool = False
    # Bounded work: most tokens one request generates (None = the model's context length), and the
    # seconds after its arrival at which a request is finished wherever it is (0 = no deadline).
    max_new_tokens: int | None = None
    request_timeout: float = 0.0
    watchdog_seconds: float = 10.0     # log a step that runs longer than this (0 = no watchdog)
    # Speculative decoding (engine/speculative/): "ngram" (prompt lookup), "draft:MODEL" (a smaller
    # model with the same vocabulary) or "off", the default for requests that do not choose; tokens
    # proposed per step and sequence; the n-gram sizes looked up.
    speculative: str = "ngram"
    num_speculative_tokens: int = 16
    spec_ngram_min: int = 2
    spec_ngram_max: int = 8
    # Where the model runs (engine/device.py): "cpu", "cuda" (bf16 weights, KV cache and sampling on the
    # GPU) or "auto" (cuda when torch sees one). The CLI's default is auto; here cpu, so library users
    # and tests get the same engine on every machine unless they ask.
    device: str = "cpu"
    gpu_memory_utilization: float = 0.9  # cuda: share of the free GPU memory for weights, KV cache, workspace
    # Decode steps a decode-only batch (decode_steps.py) runs back to back before the host reads their
    # tokens (engine/decode_steps.py), on a runner that can (the device one); 0 = DEFAULT_DECODE_STEPS there.
    decode_steps: int = 0

    def validate(self) -> None:
        if self.threads < 0:
            raise ConfigError(f"threads must be 0 (automatic) or more, got {self.threads}")
        for name in ("block_size", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("n_batch", "n_ubatch", "parallel"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be 0 (automatic) or more, got {getattr(self, name)}")
        for name in ("max_model_len", "max_sequence_length"):
            value = getattr(self, name)
            if value is not None and value < 2:
                raise ConfigError(f"{name} must be at least 2, got {value}")
        if self.max_total_tokens < self.block_size:
            raise ConfigError(f"max_total_tokens ({self.max_total_tokens}) is below one block ({self.block_size})")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.aging_ms <= 0:
            raise ConfigError(f"aging_ms must be positive, got {self.aging_ms}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        for name in ("request_timeout", "watchdog_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_wait_ms < 0:
            raise ConfigError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        try:
            self.spec_config().validate()
        except SpecConfigError as exc:
            raise ConfigError(str(exc)) from None
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not 0 <= self.decode_steps <= 64:
            raise ConfigError(f"decode_steps must be 0 (automatic) to 64, got {self.decode_steps}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def for_device(self, gpu: bool) -> "EngineConfig":
        """This config with the step sizes left at 0 (automatic) set for a model on a GPU or a CPU."""
        auto = GPU_STEP_SIZES if gpu else CPU_STEP_SIZES
        return replace(self, n_batch=self.n_batch or auto.n_batch, n_ubatch=self.n_ubatch or auto.n_ubatch,
                       parallel=self.parallel or auto.parallel)

    def spec_config(self) -> SpecConfig:
        method, draft_model = SpecConfig.parse_method(self.speculative)
        return SpecConfig(method, self.num_speculative_tokens, self.spec_ngram_min, self.spec_ngram_max,
                          draft_model=draft_model)

    @property
    def num_blocks(self) -> int:
        return self.max_total_tokens // self.block_size

    def context_limit(self, model_context: int) -> int:
        """Per-sequence context: the model's own, capped by max_model_len and max_sequence_length."""
        caps = [c for c in (self.max_model_len, self.max_sequence_length) if c is not None]
        return min([model_context, *caps])
