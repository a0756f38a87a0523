"""`tokenmill bench`: benchmarks that print tokenmill's figures next to a peer (transformers) measured
in the same run, with the ratio.

    tokenmill bench offline [--num-prompts 64 --prompt-len 100 --max-tokens 128 ...]
    tokenmill bench single-stream [--dtypes bf16,fp32 ...]

The same benchmarks run as scripts: bench/offline.py, bench/single_stream.py."""
from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARKS = {
    "offline": ("tokenmill.bench.offline", "throughput of N prompts submitted at once (continuous batching)"),
    "single-stream": ("tokenmill.bench.single_stream", "load time and one-request greedy decode tokens/s"),
    "serve": ("tokenmill.bench.serving", "load generator against a running server (OpenAI/Ollama API)"),
    "shared-prefix": ("tokenmill.bench.shared_prefix", "TTFT of a burst sharing a long prefix vs unique prefixes"),
    "quality": ("tokenmill.bench.quality", "greedy agreement and logit error of bf16/int4 vs fp32"),
    "structured": ("tokenmill.bench.structured", "a batch of JSON-schema requests vs the same batch unconstrained"),
    "ray": ("tokenmill.bench.ray_routing", "N Ray replicas (prefix vs default router) vs 1 process of N threads"),
    "ray-sim": ("tokenmill.bench.ray_sim", "simulated R-replica cluster: prefix router vs power of two choices"),
    "speculative": ("tokenmill.bench.speculative", "prompt-lookup speculative decoding on vs off: tok/s, acceptance, "
                    "same tokens"),
    "scaling": ("tokenmill.bench.scaling", "decode, prefill and 64-sequence decode at 1..N threads vs llama.cpp"),
    "chat": ("tokenmill.bench.chat", "a multi-turn chat, the whole conversation each turn: prompt tokens computed "
             "and TTFT per turn vs llama.cpp"),
}


# Which extra of pyproject.toml installs a package some benchmark imports.
_EXTRA_OF = {"httpx": "bench", "matplotlib": "bench", "ray": "ray"}


def _usage() -> str:
    rows = "\n".join(f"  {name:15}{help_}" for name, (_, help_) in BENCHMARKS.items())
    return f"usage: tokenmill bench {{{','.join(BENCHMARKS)}}} [options]\n\nbenchmarks:\n{rows}\n"


def cmd_bench(args: argparse.Namespace) -> int:
    rest = list(getattr(args, "rest", None) or [])
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest or rest[0] in ("-h", "--help"):
        print(_usage(), end="")
        return 0 if rest else 2
    name, argv = rest[0].replace("_", "-"), rest[1:]
    if name not in BENCHMARKS:
        print(f"tokenmill bench: unknown benchmark {rest[0]!r}\n\n{_usage()}", end="", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(BENCHMARKS[name][0])
        return module.main(argv, prog=f"tokenmill bench {name}")
    except ModuleNotFoundError as exc:
        # A package `make serve` (pip install tokenmill) does not install: say which extra has it.
        if exc.name is None or exc.name.split(".")[0] == "tokenmill":
            raise
        package = exc.name.split(".")[0]
        extra = _EXTRA_OF.get(package)
        hint = f"pip install 'tokenmill[{extra}]'" if extra else f"pip install {package}"
        print(f"tokenmill bench {name} needs the Python package {package!r}, which this install lacks: {hint}",
              file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - only the model errors below are the user's; the rest re-raise
        if not isinstance(exc, _model_errors()):
            raise
        # `--model nope` or a file that is no GGUF: the user's mistake, not a traceback.
        print(f"tokenmill bench {name}: error: {exc}", file=sys.stderr)
        return 1


def _model_errors() -> tuple[type[Exception], ...]:
    """What a benchmark raises for a model it cannot find or load (imported late: torch comes with them)."""
    from tokenmill.gguf.reader import GGUFError
    from tokenmill.model.registry import ModelLoadError
    from tokenmill.store.catalog import StoreError
    from tokenmill.tokenizer.chat_template import TokenizerError

    return StoreError, GGUFError, ModelLoadError, TokenizerError
