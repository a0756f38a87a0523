"""Ollama's blob workflow against a live server: HEAD/POST /api/blobs, /api/create with `files`, the
model served under its name on every API, and /api/delete removing the blob; every bad upload (wrong
digest, cut short, too large, not GGUF, crafted GGUF) is a 4xx with a JSON error that names no
server path and quotes no file bytes, and leaves nothing in the store; a request never names a file."""
from __future__ import annotations

import hashlib
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from crafted_gguf import crafted_variants
from server_helpers import start_server
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.cli import main


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def leftovers(models: Path) -> list[str]:
    """What the store holds besides the two installed tiny models."""
    found = [str(p.relative_to(models)) for p in models.rglob("*") if p.is_file()]
    return sorted(f for f in found if f not in {"tiny-a.gguf", "tiny-b.gguf", "blobs/.lock"}
                  and not f.startswith(("tiny-a.gguf.", "tiny-b.gguf.")))


def assert_clean_error(r: httpx.Response, status: int, *secrets: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    message = r.json()["error"]
    message = message["message"] if isinstance(message, dict) else message
    for secret in secrets:
        assert secret not in r.text, (secret, r.text)
    return message


@pytest.fixture
def own_model(tmp_path) -> Path:
    """A tiny model of the client's, outside the server's store."""
    (tmp_path / "client").mkdir()
    return write_tiny_llama(tmp_path / "client" / "mine.gguf", TinyLlamaSpec(seed=7))


@pytest.fixture
def served(store):
    server, host = start_server("tiny-a", kv_size=2048)
    assert host.wait_ready(30), host.error
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c, store
    server.stop()


def test_push_create_serve_and_delete(served, own_model):
    c, models = served
    data = own_model.read_bytes()
    digest = sha(data)
    assert c.head(f"/api/blobs/{digest}").status_code == 404
    assert c.post(f"/api/blobs/{digest}", content=data).status_code == 201
    assert c.head(f"/api/blobs/{digest}").status_code == 200
    assert c.post(f"/api/blobs/{digest}", content=data).status_code == 200  # held: nothing to do
    r = c.post("/api/create", json={"model": "pushed", "files": {"mine.gguf": digest}, "system": "Be brief.",
                                    "parameters": {"num_predict": 3, "temperature": 0}, "stream": False})
    assert r.status_code == 200 and r.json() == {"status": "success"}
    assert "pushed" in {m["name"] for m in c.get("/api/tags").json()["models"]}
    assert "pushed" in {m["id"] for m in c.get("/v1/models").json()["data"]}
    shown = c.post("/api/show", json={"model": "pushed"}).json()
    assert shown["system"] == "Be brief." and shown["details"]["family"] == "llama"
    assert f"FROM {digest}\n" in shown["modelfile"]
    base = c.post("/api/show", json={"model": "tiny-a"}).json()["modelfile"]
    assert "FROM tiny-a\n" in base and str(models) not in base  # a name, not where the server keeps it
    g = c.post("/api/generate", json={"model": "pushed", "prompt": "hello", "stream": False})
    assert g.status_code == 200 and g.json()["model"] == "pushed" and g.json()["eval_count"] == 3
    ch = c.post("/api/chat", json={"model": "pushed", "stream": False, "messages": [{"role": "user", "content": "hi"}]})
    assert ch.status_code == 200 and ch.json()["eval_count"] == 3
    o = c.post("/v1/chat/completions", json={"model": "pushed", "messages": [{"role": "user", "content": "hi"}]})
    assert o.status_code == 200 and o.json()["usage"]["completion_tokens"] == 3
    # Its own weights, not tiny-a's.
    a = c.post("/api/generate", json={"model": "tiny-a", "prompt": "hello", "stream": False,
                                      "options": {"num_predict": 3, "temperature": 0}}).json()
    assert a["context"] != g.json()["context"] or a["response"] != g.json()["response"]
    # A second model from the same blob; the blob goes with the last of them.
    assert c.post("/api/create", json={"model": "pushed2", "from": digest, "stream": False}).status_code == 200
    assert c.request("DELETE", "/api/delete", json={"model": "pushed"}).status_code == 200
    assert c.head(f"/api/blobs/{digest}").status_code == 200
    assert c.request("DELETE", "/api/delete", json={"model": "pushed2"}).status_code == 200
    assert c.head(f"/api/blobs/{digest}").status_code == 404
    assert leftovers(models) == []


def test_bad_uploads_are_4xx_json_and_leave_nothing(served, own_model, tmp_path):
    c, models = served
    data = own_model.read_bytes()
    secrets = (str(tmp_path), str(models), "root:")
    for bad in ("sha256:abc", "md5:" + "0" * 64, "sha256:" + "z" * 64, "x"):
        assert c.head(f"/api/blobs/{bad}").status_code == 400
        assert "digest" in assert_clean_error(c.post(f"/api/blobs/{bad}", content=data), 400, *secrets)
    # The body is not what the digest names.
    message = assert_clean_error(c.post(f"/api/blobs/{sha(b'other')}", content=data), 400, *secrets)
    assert "mismatch" in message
    # Right digest, but not a usable GGUF: each crafted file is refused, whatever it claims.
    for name, body in crafted_variants(own_model).items():
        message = assert_clean_error(c.post(f"/api/blobs/{sha(body)}", content=body), 400, *secrets)
        assert "GGUF" in message or "architecture" in message, (name, message)
        assert c.head(f"/api/blobs/{sha(body)}").status_code == 404
    # A streamed (chunked) body is hashed as it comes, as a sized one is.
    chunks = (data[i:i + 4096] for i in range(0, len(data), 4096))
    assert c.post(f"/api/blobs/{sha(data)}", content=chunks).status_code == 201
    assert leftovers(models) == [f"blobs/sha256-{sha(data)[7:]}", f"blobs/sha256-{sha(data)[7:]}.json"]


def test_a_body_cut_short_leaves_nothing(served, own_model):
    c, models = served
    data = own_model.read_bytes()
    url = httpx.URL(str(c.base_url))
    with socket.create_connection((url.host, url.port)) as s:
        s.sendall(f"POST /api/blobs/{sha(data)} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream"
                  f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data[: len(data) // 2])
        time.sleep(0.3)  # the server has started writing the blob
    deadline = time.monotonic() + 10
    while leftovers(models) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers(models) == []
    assert c.head(f"/api/blobs/{sha(data)}").status_code == 404


def test_blob_size_limit_is_a_413(store, own_model, tmp_path):
    data = own_model.read_bytes()
    assert len(data) > 100_000
    server, _ = start_server("", max_blob_gb=0.0001)  # 100 kB
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            declared = c.post(f"/api/blobs/{sha(data)}", content=data)
            assert "limit" in assert_clean_error(declared, 413, str(tmp_path))
            chunked = c.post(f"/api/blobs/{sha(data)}", content=(data[i:i + 8192] for i in range(0, len(data), 8192)))
            assert "limit" in assert_clean_error(chunked, 413, str(tmp_path))
        assert leftovers(store) == []
    finally:
        server.stop()


def test_blob_uploads_are_not_held_to_the_json_body_limit(store, own_model):
    # The generic request body limit (--max-body-bytes) is for JSON; blobs have --max-blob-gb.
    data = own_model.read_bytes()
    server, _ = start_server("", max_body_bytes=64 * 1024)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert len(data) > 64 * 1024
            assert c.post(f"/api/blobs/{sha(data)}", content=data).status_code == 201
            assert c.post("/api/create", content=b"{" + b" " * 70_000 + b"}").status_code == 413
    finally:
        server.stop()


@pytest.mark.parametrize("field", ["from", "modelfile"])
def test_requests_never_name_files(served, tmp_path, field):
    c, models = served
    existing = write_tiny_llama(tmp_path / "exists.gguf")

    def refused(path: str) -> str:
        body = {"from": path} if field == "from" else {"modelfile": f"FROM {path}\nSYSTEM hi\n"}
        r = c.post("/api/create", json={"model": "probe", "stream": False, **body})
        return assert_clean_error(r, 400, str(tmp_path), "root:", str(models)).replace(path, "<p>")

    # An existing file and a missing one of the same shape get the same answer.
    assert refused(str(existing)) == refused(str(tmp_path / "missing.gguf"))
    assert refused("/etc/passwd") == refused("/etc/no-such-file")
    assert refused(str(models / "tiny-a.gguf")) == refused(str(models / "nope.gguf"))
    for path in ("./exists.gguf", "~/x.gguf", "..\\x.gguf", "C:\\x.gguf", "../../etc/passwd"):
        refused(path)
    assert leftovers(models) == []


def test_create_refuses_what_it_cannot_do(served, own_model):
    c, models = served
    data = own_model.read_bytes()
    digest = sha(data)
    cases = [({"from": "tiny-a", "quantize": "q4_K_M"}, "quantize"),
             ({"from": "tiny-a", "adapters": {"a.gguf": digest}}, "not found"),  # an adapter not pushed
             ({"files": {"mine.gguf": digest}}, "not found"),  # not pushed
             ({"files": {"mine.gguf": "/etc/passwd"}}, "digest"),
             ({"files": {"a.gguf": digest, "b.gguf": digest}}, "one"),
             ({"files": "mine.gguf"}, "files"),
             ({"files": {"mine.gguf": digest}, "from": "tiny-a"}, "either")]
    for body, word in cases:
        r = c.post("/api/create", json={"model": "x", "stream": False, **body})
        assert word in assert_clean_error(r, 400, "root:"), (body, r.text)
    assert leftovers(models) == []


def test_load_failures_and_old_records_reveal_no_file(served, tmp_path):
    c, models = served
    (models / "broken.gguf").write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 4)
    r = c.post("/api/generate", json={"model": "broken", "prompt": "hi", "stream": False})
    message = assert_clean_error(r, 422, str(models), "root:", "b'")  # the file is at fault, not the server
    assert message == "model 'broken' could not be loaded: not a valid GGUF file"
    (models / "broken.gguf").unlink()
    # Records an older tokenmill let a client write: a model "made FROM" a file outside the store.
    (models / "derived").mkdir(exist_ok=True)
    outside = write_tiny_llama(tmp_path / "outside.gguf")
    answers = []
    for name, base in (("old-etc", "/etc/passwd"), ("old-file", str(outside)), ("old-gone", "/no/such.gguf")):
        (models / "derived" / f"{name}.json").write_text(json.dumps({"name": name, "from": base}))
        r = c.post("/api/generate", json={"model": name, "prompt": "hi", "stream": False})
        answers.append(assert_clean_error(r, 404, str(tmp_path), "/etc", "root:").replace(name, "<n>"))
    assert len(set(answers)) == 1, answers


def test_cli_create_pushes_the_modelfiles_file_to_the_server(store, own_model, monkeypatch, capsys):
    server, _ = start_server("tiny-a", kv_size=2048)
    monkeypatch.setenv("TOKENMILL_HOST", f"127.0.0.1:{server.port}")
    try:
        modelfile = own_model.parent / "Modelfile"
        modelfile.write_text('FROM ./mine.gguf\nSYSTEM """Answer briefly."""\nPARAMETER num_predict 2\n')
        monkeypatch.chdir("/")  # FROM is relative to the Modelfile's folder, not the working directory
        assert main(["create", "cli-made", "-f", str(modelfile)]) == 0
        out, err = capsys.readouterr()
        assert out.strip() == "success" and "transferring model data" in err
        digest = sha(own_model.read_bytes())[7:]
        assert (store / "blobs" / f"sha256-{digest}").read_bytes() == own_model.read_bytes()
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/api/generate", json={"model": "cli-made", "prompt": "hi", "stream": False})
            # The created model's PARAMETER num_predict 2 holds: two tokens, or fewer only when a sampled
            # end of sequence came first (the tiny model's draws vary).
            assert r.status_code == 200 and r.json()["eval_count"] <= 2
            assert (r.json()["eval_count"] == 2) == (r.json()["done_reason"] == "length")
        assert main(["create", "cli-made-2", "-f", str(modelfile)]) == 0
        assert "transferring" not in capsys.readouterr().err  # the server holds it: not sent again
        assert main(["rm", "cli-made", "cli-made-2"]) == 0
        assert not (store / "blobs" / f"sha256-{digest}").exists()
        modelfile.write_text("FROM ./missing.gguf\n")
        assert main(["create", "x", "-f", str(modelfile)]) == 1
        assert "no such file" in capsys.readouterr().err
    finally:
        server.stop()


def test_cli_create_without_a_server_imports_the_file(store, own_model, monkeypatch, capsys):
    from tokenmill.server.commands import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    monkeypatch.setenv("TOKENMILL_HOST", f"127.0.0.1:{sock.getsockname()[1]}")
    sock.close()
    modelfile = own_model.parent / "Modelfile"
    modelfile.write_text("FROM mine.gguf\nPARAMETER temperature 0\n")
    assert main(["create", "local-made", "-f", str(modelfile)]) == 0
    digest = sha(own_model.read_bytes())[7:]
    assert (store / "blobs" / f"sha256-{digest}").is_file()
    assert main(["show", "local-made"]) == 0 and "temperature 0" in capsys.readouterr().out
    assert main(["rm", "local-made"]) == 0
    assert leftovers(store) == []


@pytest.mark.real_model
def test_the_ollama_client_pushes_smollm2_and_chats_with_it(smollm2_path, tmp_path, monkeypatch, capsys):
    import ollama

    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))  # a store without SmolLM2 in it
    server, _ = start_server("", dtype="auto", kv_size=4096)
    monkeypatch.setenv("TOKENMILL_HOST", f"127.0.0.1:{server.port}")
    try:
        # `tokenmill create` with a Modelfile beside the file, as the user does.
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / smollm2_path.name).symlink_to(smollm2_path)
        (tmp_path / "mine" / "Modelfile").write_text(f"FROM ./{smollm2_path.name}\nPARAMETER num_predict 4\n")
        assert main(["create", "smol-cli", "-f", str(tmp_path / "mine" / "Modelfile")]) == 0
        assert "transferring model data" in capsys.readouterr().err
        client = ollama.Client(host=server.url)
        assert client.generate("smol-cli", "The capital of France is").eval_count == 4
        # The ollama client's own way (it POSTs without asking first: a held blob is a 200).
        digest = client.create_blob(smollm2_path)
        assert digest == sha(smollm2_path.read_bytes())
        r = client.create(model="smol-pirate", files={smollm2_path.name: digest},
                          system="You are a pirate. Always answer like a pirate.",
                          parameters={"temperature": 0, "num_predict": 24})
        assert r.status == "success"
        assert "smol-pirate" in {m.model for m in client.list().models}
        answer = client.chat("smol-pirate", messages=[{"role": "user", "content": "Who are you?"}])
        assert answer.eval_count == 24 and answer.message.content.strip()
        explicit = client.chat("smol-pirate", messages=[
            {"role": "system", "content": "You are a pirate. Always answer like a pirate."},
            {"role": "user", "content": "Who are you?"}])
        assert explicit.message.content == answer.message.content  # the SYSTEM prompt was applied
        assert client.delete("smol-pirate").status == "success"
        assert list((tmp_path / "home" / "models" / "blobs").glob("sha256-*"))  # smol-cli still uses it
        assert client.delete("smol-cli").status == "success"
        assert not list((tmp_path / "home" / "models" / "blobs").glob("sha256-*"))
    finally:
        server.stop()


def test_a_trickling_upload_gets_408_and_leaves_nothing(store, own_model):
    # After --body-timeout the upload must average MIN_RATE: a byte every 0.1 s is cut off.
    data = own_model.read_bytes()
    server, _ = start_server("", body_timeout=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(f"POST /api/blobs/{sha(data)} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      f"Content-Length: {len(data)}\r\n\r\n".encode())
            s.settimeout(0.1)
            reply = b""
            for i in range(100):
                try:
                    s.sendall(data[i:i + 1])
                    reply += s.recv(4096)
                except (TimeoutError, socket.timeout):
                    continue
                except OSError:
                    break
                if reply:
                    break
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply
        assert "slower than" in json.loads(body)["error"]
        deadline = time.monotonic() + 5
        while leftovers(store) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leftovers(store) == []
    finally:
        server.stop()


def test_a_full_disk_is_a_507_without_paths(served, own_model, monkeypatch):
    import errno
    import os

    from tokenmill.store import blobs

    c, models = served
    data = own_model.read_bytes()

    def full(self, chunk):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(models / "blobs" / "x.tmp"))

    monkeypatch.setattr(blobs.BlobUpload, "write", full)
    r = c.post(f"/api/blobs/{sha(data)}", content=data)
    assert "No space left" in assert_clean_error(r, 507, str(models))
    assert leftovers(models) == []


def test_a_model_made_from_the_file_serve_was_started_with_is_served(tiny_gguf, store):
    # `tokenmill serve ./x.gguf` then (an older) `cp x y` recorded y as made from that path: still served.
    server, host = start_server(str(tiny_gguf), kv_size=2048)
    try:
        assert host.wait_ready(30)
        (store / "derived").mkdir()
        (store / "derived" / "alias.json").write_text(json.dumps({"name": "alias", "from": str(tiny_gguf)}))
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/api/generate", json={"model": "alias", "prompt": "hi", "stream": False,
                                              "options": {"num_predict": 2}})
            assert r.status_code == 200 and r.json()["model"] == "alias"
    finally:
        server.stop()
