"""`tokenmill batch`: a file of requests in OpenAI's batch format answered in process, through the
server's own routes: results in input order with each request's status and body (the same body a
server answers), lines that are no request reported in `error`, and the rest still answered."""
from __future__ import annotations

import json

import httpx

from server_helpers import start_server
from tokenmill.cli import main


def _request(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


CHAT = {"model": "tiny-a", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}


def test_a_batch_file_answered_in_order(store, nobody_listens, tmp_path, capsys):
    requests = [_request(f"chat-{i}", "/v1/chat/completions",
                         {**CHAT, "messages": [{"role": "user", "content": f"hello {i}"}]}) for i in range(12)]
    requests += [_request("plain", "/v1/completions", {"model": "tiny-b", "prompt": "once", "max_tokens": 4}),
                 _request("emb", "/v1/embeddings", {"model": "tiny-a", "input": "hi"}),
                 _request("msg", "/v1/messages", {"model": "tiny-a", "max_tokens": 3,
                                                  "messages": [{"role": "user", "content": "hi"}]}),
                 _request("resp", "/v1/responses", {"model": "tiny-a", "input": "hi", "max_output_tokens": 3}),
                 _request("streamed", "/v1/chat/completions", {**CHAT, "stream": True}),
                 _request("path", "/v1/chat/completions", {**CHAT, "model": "/etc/passwd"}),
                 _request("long", "/v1/chat/completions",
                          {**CHAT, "messages": [{"role": "user", "content": "x " * 900}]}),
                 _request("delete", "/api/delete", {"model": "tiny-a"}),
                 {"method": "POST", "url": "/v1/completions", "body": {}}]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in requests) + "\n{not json\n\n")
    out = tmp_path / "out.jsonl"
    assert main(["batch", "tiny-a", "-i", str(src), "-o", str(out), "--concurrency", "5", "--dtype", "fp32"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [r.get("custom_id") for r in requests] + [None]
    by_id = {r["custom_id"]: r for r in results}
    for i in range(12):
        r = by_id[f"chat-{i}"]
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["id"].startswith("batch_req_")
        assert r["response"]["body"]["object"] == "chat.completion"
    assert by_id["plain"]["response"]["body"]["model"] == "tiny-b"  # a model on demand
    assert by_id["emb"]["response"]["body"]["data"][0]["embedding"]
    assert by_id["msg"]["response"]["body"]["type"] == "message"
    assert by_id["resp"]["response"]["body"]["object"] == "response"
    assert by_id["streamed"]["response"]["body"]["object"] == "chat.completion"  # answered whole
    assert by_id["path"]["response"]["status_code"] == 400
    assert by_id["long"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert by_id["delete"]["error"]["code"] == "invalid_request" and by_id["delete"]["response"] is None
    assert "custom_id" in results[-2]["error"]["message"] and "not JSON" in results[-1]["error"]["message"]
    assert (store / "tiny-a.gguf").exists()
    err = capsys.readouterr().err
    assert "batch: 22 requests, 17 answered, 5 failed" in err
    # The same request to a server answers the same body (greedy; ids and times aside).
    server, host = start_server("tiny-a", kv_size=2048)
    try:
        assert host.wait_ready(30)
        direct = httpx.post(f"{server.url}/v1/chat/completions", json=requests[3]["body"], timeout=30).json()
    finally:
        server.stop()
    assert direct["choices"] == by_id["chat-3"]["response"]["body"]["choices"]


def test_a_batch_file_that_cannot_be_read_is_one_line(store, nobody_listens, tmp_path, capsys):
    assert main(["batch", "tiny-a", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.startswith("error: cannot read")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(_request("a", "/v1/chat/completions", CHAT)) + "\n")
    assert main(["batch", "no-such-model", "-i", str(src), "-o", str(tmp_path / "o")]) == 1
    assert "no-such-model" in capsys.readouterr().err
