"""`tokenmill batch -i requests.jsonl -o results.jsonl`: a file of requests in OpenAI's batch format
(one JSON object a line: custom_id, method, url, body), answered in this process with continuous
batching, as vLLM's run_batch does, and written in OpenAI's batch output format, in input order.

Each request goes through the server's own app (the same routes, checks and errors as `tokenmill
serve`), called in process without a socket, several at a time so the engine batches them. A line
that is not a request (bad JSON, no custom_id, a url that is no generation or embedding route)
gets an `error` line and the rest go on; a request the app refuses gets its `response` with the
status and error body the server would send. Bodies are answered whole (`stream` is turned off)."""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages")

App = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


async def asgi_post(app: App, path: str, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> tuple[int, bytes]:
    """POST body to path on the app, as a loopback client would (the in-process replay Ray's replicas
    use, ray/asgi_bridge.py): (status, response body)."""
    from tokenmill.ray.asgi_bridge import ForwardedRequest, ResponseStart, replay

    request = ForwardedRequest("POST", path, b"", ((b"host", b"localhost"), (b"content-type", b"application/json"),
                                                    (b"content-length", str(len(body)).encode()), *headers),
                               body, ("127.0.0.1", 0))
    status, chunks = 500, []
    async for part in replay(app, request):
        if isinstance(part, ResponseStart):
            status = part.status
        else:
            chunks.append(part)
    return status, b"".join(chunks)


@dataclass
class Line:
    """One input line, read: the request to send, or why it cannot be sent."""
    number: int
    custom_id: str | None
    url: str = ""
    body: dict | None = None
    problem: str | None = None


def read_line(number: int, text: str) -> Line:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return Line(number, None, problem=f"line {number}: not JSON ({exc.msg})")
    if not isinstance(obj, dict):
        return Line(number, None, problem=f"line {number}: not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Line(number, None, problem=f"line {number}: custom_id must be a non-empty string")
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if method != "POST" or url not in URLS:
        return Line(number, custom_id, problem=f"line {number}: method must be POST and url one of {', '.join(URLS)}")
    if not isinstance(body, dict):
        return Line(number, custom_id, problem=f"line {number}: body must be a JSON object")
    return Line(number, custom_id, url, body if url == "/v1/embeddings" else {**body, "stream": False})


def _result(line: Line, status: int | None = None, body: object = None) -> dict:
    out: dict = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": None, "error": None}
    if line.problem is not None:
        out["error"] = {"code": "invalid_request", "message": line.problem}
    else:
        out["response"] = {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}
    return out


async def run_batch(app: App, lines: list[Line], write: Callable[[dict], None], concurrency: int,
                    headers: list[tuple[bytes, bytes]] = (), progress: Callable[[int], None] = lambda n: None
                    ) -> list[dict]:
    """Every line answered by `concurrency` workers taking the next line as they free up (so a file
    of any length holds that many requests in flight, not one task a line); results written in
    input order as soon as those before them are."""
    results: list[dict | None] = [None] * len(lines)
    taken = written = 0

    async def answer(line: Line) -> dict:
        if line.problem is not None:
            return _result(line)
        status, raw = await asgi_post(app, line.url, json.dumps(line.body).encode(), list(headers))
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
        return _result(line, status, body)

    async def worker() -> None:
        nonlocal taken, written
        while taken < len(lines):
            i, taken = taken, taken + 1
            results[i] = await answer(lines[i])
            while written < len(results) and results[written] is not None:
                write(results[written])
                written += 1
                progress(written)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, max(len(lines), 1)))))
    return [r for r in results if r is not None]


def summary(results: list[dict], seconds: float) -> str:
    ok = [r for r in results if r["response"] is not None and r["response"]["status_code"] == 200]
    usage = [r["response"]["body"].get("usage") or {} for r in ok if isinstance(r["response"]["body"], dict)]
    out_tokens = sum(u.get("completion_tokens", u.get("output_tokens", 0)) or 0 for u in usage)
    return (f"batch: {len(results)} requests, {len(ok)} answered, {len(results) - len(ok)} failed, "
            f"{out_tokens} output tokens in {seconds:.1f} s ({out_tokens / max(seconds, 1e-9):.1f} tokens/s)")


def cmd_batch(args) -> int:
    from tokenmill.server.commands import check_device, check_draft, host_for, read_settings

    settings = read_settings(args)
    if isinstance(settings, int):
        return settings
    try:
        with open(args.input, encoding="utf-8") as f:
            lines = [read_line(n, text) for n, text in enumerate(f, 1) if text.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: cannot read {args.input}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 1
    if args.concurrency < 1:
        print("error: --concurrency must be at least 1", file=sys.stderr)
        return 1
    unusable = check_device(settings) or check_draft(settings)
    if unusable:
        print(f"error: {unusable}", file=sys.stderr)
        return 1
    from tokenmill.server.app import create_app

    host = host_for(settings)
    try:
        if not host.wait_ready():
            print(f"error: {host.error}", file=sys.stderr)
            return 1
        app = create_app(host, settings, shutdown_host=False)
        headers = [(b"authorization", f"Bearer {settings.api_key}".encode())] if settings.api_key else []
        start = time.perf_counter()
        with open(args.output, "w", encoding="utf-8") as out:
            def write(result: dict) -> None:
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
                out.flush()

            def progress(n: int) -> None:
                if n % 16 == 0 or n == len(lines):
                    print(f"\r{n}/{len(lines)} answered", end="", file=sys.stderr, flush=True)

            results = asyncio.run(run_batch(app, lines, write, args.concurrency, headers, progress))
        print(file=sys.stderr)
        print(summary(results, time.perf_counter() - start), file=sys.stderr)
        return 0
    except OSError as exc:
        print(f"error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        host.shutdown()
