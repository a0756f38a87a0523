"""Models on demand, as Ollama's scheduler serves them: a request naming an installed model loads it,
keep_alive unloads it, max_loaded_models and the memory budget evict the least recently used idle
model (never one with a request in flight), and /api/ps tells the truth about all of it."""
from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time

import gguf
import httpx

from server_helpers import start_server, wait_for
from tiny_model import TinyLlamaSpec, write_tiny_llama




def loaded(c: httpx.Client) -> dict[str, dict]:
    return {m["name"]: m for m in c.get("/api/ps").json()["models"]}


def generate(c: httpx.Client, model: str, n: int = 3, **extra) -> httpx.Response:
    return c.post("/api/generate", json={"model": model, "prompt": "hello", "stream": False,
                                         "options": {"num_predict": n, "temperature": 0}, **extra})


@contextlib.contextmanager
def busy_stream(server, engine, model: str):
    """A 250-token stream on `model`, its engine slowed to ~3 s, open after its first line; yields
    the rest of its lines."""
    engine.step_hook = lambda batch: time.sleep(0.01)
    try:
        with httpx.stream("POST", f"{server.url}/api/generate", timeout=60, json={
                "model": model, "prompt": "go", "options": {"num_predict": 250, "temperature": 0}}) as r:
            lines = r.iter_lines()
            next(lines)
            yield lines
    finally:
        engine.step_hook = None


def expires_in(m: dict) -> float:
    return dt.datetime.fromisoformat(m["expires_at"].replace("Z", "+00:00")).timestamp() - time.time()


def test_a_request_loads_the_model_it_names_and_both_serve_interleaved(store):
    server, host = start_server("tiny-a", kv_size=2048)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert host.wait_ready(30)
            assert set(loaded(c)) == {"tiny-a"}
            r = generate(c, "tiny-b")
            assert r.status_code == 200 and r.json()["model"] == "tiny-b" and r.json()["eval_count"] == 3
            ps = loaded(c)
            assert set(ps) == {"tiny-a", "tiny-b"}
            # The size is the weights plus the whole KV cache, and the default model stays forever.
            assert ps["tiny-b"]["size"] > (store / "tiny-b.gguf").stat().st_size
            assert ps["tiny-a"]["expires_at"] > "2030" and 200 < expires_in(ps["tiny-b"]) <= 300
            assert ps["tiny-b"]["context_length"] == 256

            # Two streams on two models at once: each engine runs its own, and both finish.
            spans = {}

            def stream(model):
                first = last = None
                with httpx.stream("POST", f"{server.url}/api/generate", timeout=30, json={
                        "model": model, "prompt": "hi", "options": {"num_predict": 60, "temperature": 0}}) as r:
                    for line in r.iter_lines():
                        if line:
                            first = first or time.monotonic()
                            last = time.monotonic()
                            final = line
                spans[model] = (first, last, final)

            threads = [threading.Thread(target=stream, args=(m,)) for m in ("tiny-a", "tiny-b")]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            (a0, a1, fa), (b0, b1, fb) = spans["tiny-a"], spans["tiny-b"]
            assert '"eval_count":60' in fa.replace(" ", "") and '"eval_count":60' in fb.replace(" ", "")
            assert a0 < b1 and b0 < a1  # they overlapped in time
            # Different weights: the two models do not answer alike.
            assert generate(c, "tiny-a", 8).json()["response"] != generate(c, "tiny-b", 8).json()["response"]
    finally:
        server.stop()


def test_unknown_model_is_ollamas_404_and_paths_are_not_loaded_by_request(store, tiny_gguf):
    server, host = start_server("tiny-a", kv_size=2048)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = generate(c, "nope")
            assert r.status_code == 404 and r.json()["error"] == 'model "nope" not found, try pulling it first'
            r = c.post("/v1/chat/completions", json={"model": str(tiny_gguf), "messages": [
                {"role": "user", "content": "x"}]})
            # A path is not a model name: 400 naming the field, and nothing is opened.
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            assert str(tiny_gguf.parent) not in r.text
            assert set(loaded(c)) <= {"tiny-a"}
    finally:
        server.stop()


def test_keep_alive_zero_unloads_after_the_request_and_expiry_unloads_idle_models(store):
    server, host = start_server("tiny-a", kv_size=2048)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert host.wait_ready(30)
            assert generate(c, "tiny-b", keep_alive=0).status_code == 200
            assert wait_for(lambda: "tiny-b" not in loaded(c), 5)
            r = generate(c, "tiny-b", keep_alive="1s")
            assert r.status_code == 200
            assert 0 < expires_in(loaded(c)["tiny-b"]) <= 1.5
            assert wait_for(lambda: "tiny-b" not in loaded(c), 5)
            assert "tiny-a" in loaded(c)  # the default model does not expire on its own
            # An empty prompt loads (done_reason "load"); with keep_alive 0 it unloads.
            r = c.post("/api/generate", json={"model": "tiny-b", "keep_alive": "10m"})
            assert r.json()["done_reason"] == "load" and 590 < expires_in(loaded(c)["tiny-b"]) <= 600
            r = c.post("/api/chat", json={"model": "tiny-b", "messages": [], "keep_alive": 0})
            assert r.json()["done_reason"] == "unload" and r.json()["done"] is True
            assert wait_for(lambda: "tiny-b" not in loaded(c), 5)
            assert c.post("/api/generate", json={"model": "tiny-a", "keep_alive": "1h2x"}).status_code == 400
            # The server keeps answering requests without a model name from its default model.
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "tiny-a"
    finally:
        server.stop()


def test_the_keep_alive_received_last_wins_over_the_request_finishing_last(store):
    server, host = start_server("tiny-a", kv_size=2048)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert host.wait_ready(30)
            assert generate(c, "tiny-b").status_code == 200
            # An unload received while a stream runs: the stream finishes, then the model unloads
            # (the stream's own default keep_alive, applied as it ends, does not bring it back).
            with busy_stream(server, host.find_loaded("tiny-b").engine, "tiny-b") as lines:
                r = c.post("/api/generate", json={"model": "tiny-b", "keep_alive": 0})
                assert r.status_code == 200 and r.json()["done_reason"] == "unload"
                assert "tiny-b" in loaded(c)  # busy: not unloaded under the stream
                assert '"done":true' in [line for line in lines if line][-1].replace(" ", "")
            assert wait_for(lambda: "tiny-b" not in loaded(c), 5)

            # A request with its own keep_alive received after the unload supersedes it.
            assert generate(c, "tiny-b").status_code == 200
            with busy_stream(server, host.find_loaded("tiny-b").engine, "tiny-b") as lines:
                assert c.post("/api/generate", json={"model": "tiny-b", "keep_alive": 0}).json()["done_reason"] == "unload"
                assert generate(c, "tiny-b", keep_alive="10m").status_code == 200
                for _ in lines:
                    pass
            time.sleep(0.6)  # more than the reaper's period
            assert 590 < expires_in(loaded(c)["tiny-b"]) <= 600
    finally:
        server.stop()


def test_quantization_is_the_declared_file_type_loaded_or_not(store):
    # As gemma3's Q4_K_M file: its tensors are mostly Q8_0, but the converter declared Q4_K_M.
    write_tiny_llama(store / "tiny-q.gguf", TinyLlamaSpec(seed=3, weight_type=gguf.GGMLQuantizationType.Q8_0,
                                                          file_type=int(gguf.LlamaFileType.MOSTLY_Q4_K_M)))
    server, host = start_server("tiny-a", kv_size=2048)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert host.wait_ready(30)

            def levels() -> tuple[str, str]:
                [tag] = [m for m in c.get("/api/tags").json()["models"] if m["name"] == "tiny-q"]
                shown = c.post("/api/show", json={"model": "tiny-q"}).json()
                return tag["details"]["quantization_level"], shown["details"]["quantization_level"]

            assert levels() == ("Q4_K_M", "Q4_K_M")  # not loaded: read from the file's header
            assert generate(c, "tiny-q").status_code == 200
            assert loaded(c)["tiny-q"]["details"]["quantization_level"] == "Q4_K_M"
            assert levels() == ("Q4_K_M", "Q4_K_M")  # loaded: the same answer
    finally:
        server.stop()


def test_max_loaded_models_evicts_the_idle_model_but_never_a_busy_one(store):
    server, host = start_server("tiny-a", kv_size=2048, max_loaded_models=1)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert host.wait_ready(30)
            assert generate(c, "tiny-b").status_code == 200
            assert set(loaded(c)) == {"tiny-b"}  # tiny-a was idle: unloaded to make room
            # A stream keeps tiny-b busy: a request for tiny-a waits until it is done.
            events = []
            with busy_stream(server, host.find_loaded("tiny-b").engine, "tiny-b") as lines:
                waiter = threading.Thread(target=lambda: events.append(("a", generate(c, "tiny-a"), time.monotonic())))
                waiter.start()
                time.sleep(0.5)
                assert waiter.is_alive() and set(loaded(c)) == {"tiny-b"}
                for _ in lines:
                    pass
                stream_end = time.monotonic()
            waiter.join(30)
            [(_, r, answered)] = events
            assert r.status_code == 200 and r.json()["model"] == "tiny-a" and answered > stream_end
            assert wait_for(lambda: set(loaded(c)) == {"tiny-a"}, 5)
    finally:
        server.stop()


def test_memory_budget_sizes_the_kv_cache_and_evicts_by_size(store):
    # A tiny model is 0.4 MB of weights and 1 MB of fp32 KV cache for 2048 tokens: in a 1.3 MB budget
    # its KV cache is cut to fit, and two models do not fit side by side.
    server, host = start_server("tiny-a", kv_size=2048, max_memory_gb=0.0013)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert host.wait_ready(30)
            assert generate(c, "tiny-b").status_code == 200
            ps = loaded(c)
            assert set(ps) == {"tiny-b"} and ps["tiny-b"]["size"] <= 1_300_000
        assert 1024 < host.find_loaded("tiny-b").engine.cfg.max_total_tokens < 2048
    finally:
        server.stop()


def test_no_room_within_the_wait_is_503_with_retry_after(store):
    server, host = start_server("tiny-a", kv_size=2048, max_loaded_models=1, model_wait_timeout=0.5)
    try:
        assert host.wait_ready(30)
        with httpx.Client(base_url=server.url, timeout=30) as c, \
                busy_stream(server, host.current.engine, "tiny-a") as lines:
            r = generate(c, "tiny-b")
            assert r.status_code == 503 and r.headers["retry-after"] == "1" and "no room" in r.json()["error"]
            assert set(loaded(c)) == {"tiny-a"}
            for _ in lines:
                pass
            # Once idle, tiny-a makes room. The 0.5 s wait also covers the load itself, which a busy
            # machine may overrun: a client retries after Retry-After, as the 503 tells it to.
            deadline = time.monotonic() + 15
            while (r := generate(c, "tiny-b")).status_code == 503 and time.monotonic() < deadline:
                time.sleep(float(r.headers["retry-after"]))
            assert r.status_code == 200, r.text
    finally:
        server.stop()
