"""Models loaded, unloaded, evicted and deleted while requests for them are in flight: every request
ends (answered, or a JSON error with the right status), nothing hangs, and the server stays healthy."""
from __future__ import annotations

import threading

import httpx

from server_helpers import store_server, wait_for
from tokenmill.server.model_host import default_loader


def generate(url: str, model: str, n: int = 3, timeout: float = 15) -> httpx.Response:
    return httpx.post(f"{url}/api/generate", timeout=timeout, json={
        "model": model, "prompt": "hello", "stream": False, "options": {"num_predict": n, "temperature": 0}})


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["r"] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["r"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def gated_loader(model: str, gate: threading.Event):
    """The server's loader, holding the load of `model` until gate is set (10 s at most)."""
    def loader(spec, report):
        if model in spec.model:
            gate.wait(10)
        return default_loader(spec, report)
    return loader


def test_a_model_just_loaded_for_waiting_requests_is_not_evicted_before_they_run(tmp_path):
    # max_loaded_models 1: tiny-b loads for one request while a request for tiny-c waits to load next.
    # tiny-c's load used to evict tiny-b the moment it was ready, before the request that loaded it
    # had taken it (its waiter polls), which then ran on a shut-down engine and hung forever.
    holder: dict = {}

    def loader(spec, report):
        if "tiny-b" in spec.model:  # finish only once tiny-c's load is queued behind this one
            assert wait_for(lambda: len(holder["host"]._pending) == 2)
        return default_loader(spec, report)

    with store_server(tmp_path, extra_models=2, max_loaded_models=1, loader=loader) as (c, _, host):
        holder["host"] = host
        url = str(c.base_url)
        tb, b = in_thread(generate, url, "tiny-b")
        assert wait_for(lambda: len(host._pending) == 1)
        tc, cc = in_thread(generate, url, "tiny-c")
        tb.join(20)
        tc.join(20)
        for out in (b, cc):
            r = out["r"]
            assert isinstance(r, httpx.Response), r
            assert r.status_code == 200 and r.json()["eval_count"] == 3, r.text
        assert [m["name"] for m in c.get("/api/ps").json()["models"]] == ["tiny-c"]
        assert c.get("/api/version").status_code == 200


def test_a_model_deleted_while_it_loads_is_a_404_for_the_requests_waiting_for_it(tmp_path):
    gate = threading.Event()
    loader = gated_loader("tiny-b", gate)

    with store_server(tmp_path, extra_models=1, loader=loader) as (c, models, host):
        t, out = in_thread(generate, str(c.base_url), "tiny-b")
        assert wait_for(lambda: len(host._pending) == 1)
        assert c.request("DELETE", "/api/delete", json={"model": "tiny-b"}).status_code == 200
        gate.set()
        t.join(15)
        r = out["r"]
        # The model is gone, not the server broken: 404, as for any model not installed.
        assert isinstance(r, httpx.Response) and r.status_code == 404, r
        assert "tiny-b" in r.json()["error"] and str(models) not in r.text
        assert [m["name"] for m in c.get("/api/ps").json()["models"]] == ["tiny-a"]
        assert generate(str(c.base_url), "tiny-a").status_code == 200


def test_the_default_model_switched_away_from_serves_the_request_that_holds_it(tmp_path):
    import asyncio

    from tokenmill.engine import SamplingParams

    with store_server(tmp_path, extra_models=1) as (c, _, host):
        async def run() -> list:
            lease = await host.acquire(None)  # a request has its model, and has not submitted yet
            old = lease.aengine
            try:
                assert c.post("/load", json={"model": "tiny-b", "kv_size": 2048}).status_code == 202
                assert host.wait_ready(20) and host.current.name == "tiny-b"
                # The retired engine waits for the lease, not only for requests already running:
                # shut down under it, the request's stream never ended.
                assert not wait_for(lambda: old._stopping, 0.3)
                params = SamplingParams(max_tokens=3, min_tokens=3, temperature=0)
                return [ev async for ev in old.generate(lease.engine.tokenizer.encode("hi"), params)], old
            finally:
                lease.release()

        events, old = asyncio.run(asyncio.wait_for(run(), 10))
        assert events[-1].finished and sum(len(e.token_ids) for e in events) == 3
        # Released, it retires: its engine thread ends.
        assert wait_for(lambda: old._stopping and not old._thread.is_alive(), 10)
        assert c.get("/api/version").status_code == 200


def test_a_copy_racing_the_delete_of_its_source_never_outlives_the_source(tmp_path, monkeypatch):
    from tokenmill.store import names

    with store_server(tmp_path, extra_models=1) as (c, models, host):
        url, real, copy = str(c.base_url).rstrip("/"), names.dependents, {}

        def racing(base_names):
            users = real(base_names)  # the delete has checked that nothing is made from tiny-b...
            copy["t"], copy["out"] = in_thread(lambda: httpx.post(
                f"{url}/api/copy", json={"source": "tiny-b", "destination": "b-copy"}, timeout=10))
            copy["t"].join(0.5)  # ...and a copy of it comes in before its file goes (or waits for it)
            return users

        monkeypatch.setattr(names, "dependents", racing)
        r = c.request("DELETE", "/api/delete", json={"model": "tiny-b"})
        copy["t"].join(10)
        copied = copy["out"]["r"]
        assert isinstance(copied, httpx.Response), copied
        # One of the two wins: the copy fails (its source is gone) or the delete is refused (in use),
        # never both succeed, leaving a model made from a file that is not there.
        assert sorted([r.status_code, copied.status_code]) in ([200, 404], [200, 409]), (r.text, copied.text)
        names_now = {m["name"] for m in c.get("/api/tags").json()["models"]}
        assert ("b-copy" in names_now) == ("tiny-b" in names_now)
        assert str(models) not in r.text + copied.text
        assert c.get("/api/version").status_code == 200


def test_requests_for_three_models_with_room_for_one_all_finish_and_no_engine_is_left_over(tmp_path):
    before = set(threading.enumerate())  # other tests' engines may still be running in this process
    with store_server(tmp_path, extra_models=2, max_loaded_models=1) as (c, _, host):
        url = str(c.base_url).rstrip("/")
        runs = [in_thread(generate, url, f"tiny-{'abc'[i % 3]}") for i in range(24)]
        for t, _ in runs:
            t.join(30)
        outs = [out["r"] for _, out in runs]
        assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in outs), outs
        ps = [m["name"] for m in c.get("/api/ps").json()["models"]]
        assert len(ps) == 1 and ps == [m.name for m in host.loaded_models()]
        # Every evicted model's engine thread has ended: one per loaded model is left.
        assert wait_for(lambda: sum(t.name == "tokenmill-engine" and t not in before
                                    for t in threading.enumerate()) == 1, 5)
        assert c.get("/api/version").status_code == 200


def test_a_model_whose_requests_all_gave_up_while_it_loaded_still_expires(tmp_path):
    gate = threading.Event()
    loader = gated_loader("tiny-b", gate)

    with store_server(tmp_path, extra_models=1, loader=loader, keep_alive="1s",
                      model_wait_timeout=0.3) as (c, _, host):
        r = generate(str(c.base_url), "tiny-b")  # gives up while the model loads
        assert r.status_code == 503 and "still loading" in r.json()["error"], r.text
        gate.set()
        assert wait_for(lambda: "tiny-b" in [m.name for m in host.loaded_models()], 10)
        # Nobody ever leased it: it unloads after the server's keep_alive all the same.
        assert wait_for(lambda: "tiny-b" not in [m.name for m in host.loaded_models()], 10)
        assert c.get("/api/version").status_code == 200
