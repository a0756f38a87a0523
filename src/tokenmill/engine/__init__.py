"""The engine: continuous batching over a paged KV cache."""
from tokenmill.engine.client import AsyncEngine, EngineDeadError
from tokenmill.engine.config import ConfigError, EngineConfig
from tokenmill.engine.engine import LLMEngine, PromptTooLongError, RequestError, TokenEvent
from tokenmill.engine.llm import LLM, CompletionOutput
from tokenmill.engine.output import OutputAssembler, TextDelta
from tokenmill.engine.request import FinishReason, Priority
from tokenmill.engine.sampling_params import InvalidSamplingParams, SamplingParams

__all__ = [
    "AsyncEngine", "CompletionOutput", "ConfigError", "EngineConfig", "EngineDeadError", "FinishReason",
    "InvalidSamplingParams", "LLM",
    "LLMEngine", "OutputAssembler", "Priority", "PromptTooLongError", "RequestError", "SamplingParams", "TextDelta",
    "TokenEvent",
]
