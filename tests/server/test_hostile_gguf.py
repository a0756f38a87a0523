"""Hostile GGUF files pushed through the public API (POST /api/blobs, /api/create, then a request
that loads the model on demand), as a client that controls every byte would: each bad file is a 4xx
with a JSON error that names no server path, leaves nothing in the store, and the server stays
healthy (/api/version answers, a good model still generates). A model whose chat template is hostile
(a loop or recursion without end, a gigabyte of text) gets a 400 on chat instead of holding the
server's event loop or its memory; a file that passes the checks but whose tokenizer cannot be built
is a 422 when loaded, not a 500."""
from __future__ import annotations

import hashlib
import resource
import struct

import gguf
import httpx
import numpy as np
import pytest

from hostile_gguf import (
    DIM,
    DROP,
    VT,
    Q,
    gguf_string,
    kv_array_header,
    kv_string,
    kv_u32,
    minimal_llama_kvs,
    raw_gguf,
    small_llama,
    tensor_info,
)
from server_helpers import store_server


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny-a server over its own store: (client, models dir, a folder for the client's files)."""
    with store_server(tmp_path_factory.mktemp("hostile-home")) as (client, models, _):
        yield client, models, tmp_path_factory.mktemp("client-files")


def error_of(r: httpx.Response, status: int, *secrets: str) -> str:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    for secret in secrets:
        assert secret not in r.text, (secret, r.text[:500])
    return message


def assert_healthy(c: httpx.Client) -> None:
    assert c.get("/api/version").status_code == 200
    r = c.post("/api/generate", json={"model": "tiny-a", "prompt": "hi", "stream": False,
                                      "options": {"num_predict": 2, "temperature": 0}})
    assert r.status_code == 200 and r.json()["eval_count"] >= 1, r.text


def assert_not_held(c: httpx.Client, models, data: bytes) -> None:
    """Neither the blob nor an upload's temp file is left in the store."""
    assert c.head(f"/api/blobs/{sha(data)}").status_code == 404
    assert not (models / "blobs" / f"sha256-{sha(data)[7:]}").exists()
    assert not list((models / "blobs").glob(".upload-*"))


def file_of(files, metadata=None, tensors=None) -> bytes:
    return small_llama(files / "m.gguf", metadata, tensors)


def structural_files(files) -> dict[str, bytes]:
    """The brief's malformed files: raw bytes no writer would produce."""
    valid = file_of(files)
    reader = gguf.GGUFReader(files / "m.gguf")
    one = [tensor_info("w", (4,), Q.F32, 0)]
    kvs = minimal_llama_kvs()
    cases = {
        "header only": valid[:24],
        "cut inside the tensor infos": valid[: reader.tensors[3].field.offset + 5],
        "cut inside the tensor data": valid[: reader.data_offset + 100],
        "wrong magic": b"GGUX" + valid[4:],
        "version 1": valid[:4] + struct.pack("<I", 1) + valid[8:],
        "version 4": valid[:4] + struct.pack("<I", 4) + valid[8:],
        "string length past the end": raw_gguf(kvs + [kv_string("x.s", "abc", length=100)]),
        "nested arrays": raw_gguf(kvs + [kv_array_header("x.n", VT.ARRAY, 2)
                                         + (struct.pack("<IQ", VT.UINT8, 1) + b"\1") * 2], one, b"\0" * 16),
        "duplicate keys": raw_gguf(kvs + [kv_u32("llama.block_count", 1)], one, b"\0" * 16),
        "duplicate tensor names": raw_gguf(kvs, one + [tensor_info("w", (4,), Q.F32, 32)], b"\0" * 64),
        "a zero dimension": raw_gguf(kvs, [tensor_info("w", (4, 0), Q.F32, 0)], b"\0" * 16),
        "a dimension of 2**64-1": raw_gguf(kvs, [tensor_info("w", (2**64 - 1,), Q.F32, 0)], b"\0" * 16),
        "dimensions whose product overflows": raw_gguf(kvs, [tensor_info("w", (2**32, 2**32, 4), Q.F32, 0)],
                                                       b"\0" * 16),
        "data offset past the end": raw_gguf(kvs, [tensor_info("w", (4,), Q.F32, 1 << 20)], b"\0" * 16),
        "overlapping tensors": raw_gguf(kvs, [tensor_info("a", (8,), Q.F32, 0), tensor_info("b", (8,), Q.F32, 0)],
                                        b"\0" * 32),
        "alignment 0": raw_gguf(kvs + [kv_u32("general.alignment", 0)], one, b"\0" * 16),
        "alignment 3": raw_gguf(kvs + [kv_u32("general.alignment", 3)], one, b"\0" * 16),
        "alignment 2**31": raw_gguf(kvs + [kv_u32("general.alignment", 2**31)], one, b"\0" * 16),
        "alignment 2**40": raw_gguf(kvs + [gguf_string("general.alignment") + struct.pack("<IQ", VT.UINT64, 2**40)],
                                    one, b"\0" * 16),
        "an unknown ggml type": raw_gguf(kvs, [tensor_info("w", (4,), 77, 0)], b"\0" * 16),
    }
    for name, value in (("2**63", 2**63), ("2**64-1", 2**64 - 1)):
        cases[f"tensor count {name}"] = valid[:8] + struct.pack("<Q", value) + valid[16:]
        cases[f"key/value count {name}"] = valid[:16] + struct.pack("<Q", value) + valid[24:]
        cases[f"array length {name}"] = raw_gguf(kvs + [kv_array_header("x.a", VT.UINT8, value)])
        cases[f"string length {name}"] = raw_gguf(kvs + [kv_string("x.s", "abc", length=value)])
    return cases


# Well-formed files (gguf.GGUFWriter) that no model can be made from: (metadata, tensors, message).
SEMANTIC = {
    "unknown architecture": ({"general.architecture": "gpt9"}, {}, "unsupported architecture 'gpt9'"),
    "no block_count": ({"llama.block_count": DROP}, {}, "'llama.block_count' is missing"),
    "no vocabulary": ({"tokenizer.ggml.tokens": DROP}, {}, "no vocabulary"),
    "a vocabulary of 0 tokens": ({"tokenizer.ggml.tokens": ([], VT.ARRAY), "tokenizer.ggml.token_type": DROP}, {},
                                 "no vocabulary"),
    "tokens that are not strings": ({"tokenizer.ggml.tokens": (list(range(271)), VT.ARRAY)}, {},
                                    "not an array of strings"),
    "an unknown tokenizer": ({"tokenizer.ggml.model": "bogus"}, {}, "unsupported tokenizer.ggml.model"),
    "heads that do not divide the embedding": ({"llama.attention.head_count": 3}, {}, "head"),
    "a head size the kernels cannot run": ({"llama.attention.head_count": 8, "llama.attention.head_count_kv": 8,
                                            "llama.rope.dimension_count": 4}, {}, "multiple of 16"),
    "a query weight of the wrong shape": ({}, {"blk.0.attn_q.weight": np.zeros((16, DIM), np.float32)},
                                          "blk.0.attn_q.weight has shape [16, 32]"),
    "a missing tensor": ({}, {"blk.0.ffn_up.weight": DROP}, "missing tensors"),
    "vocab_size above the embedding's rows": ({"llama.vocab_size": 5000}, {}, "token_embd.weight has shape"),
    "vocab_size 2**31": ({"llama.vocab_size": 2**31}, {}, "token_embd.weight has shape"),
    "feed_forward_length 2**31": ({"llama.feed_forward_length": 2**31}, {}, "ffn_gate.weight has shape"),
    "context_length 0": ({"llama.context_length": 0}, {}, "context_length is 0"),
    "context_length 2**40": ({"llama.context_length": (2**40, VT.UINT64)}, {}, "context_length is 1099511627776"),
    "a rotary table of 32 GB": ({"llama.context_length": 2**20, "llama.attention.key_length": (4096, VT.UINT32),
                                 "llama.rope.dimension_count": 4096}, {}, "rotary tables are limited"),
}


def test_every_malformed_file_is_a_400_and_leaves_nothing(served):
    c, models, files = served
    secrets = (str(models), str(files))
    for name, data in structural_files(files).items():
        message = error_of(c.post(f"/api/blobs/{sha(data)}", content=data), 400, *secrets)
        assert message.startswith("not a valid GGUF model: "), (name, message)
        assert_not_held(c, models, data)
        # Naming it in a create is a clear 400 too: nothing was kept.
        r = c.post("/api/create", json={"model": "x", "files": {"m.gguf": sha(data)}, "stream": False})
        assert "not found; push it first" in error_of(r, 400, *secrets)
    assert_healthy(c)


@pytest.mark.parametrize("name", sorted(SEMANTIC))
def test_a_file_no_model_can_be_made_from_is_refused_when_pushed(served, name):
    c, models, files = served
    metadata, tensors, expected = SEMANTIC[name]
    data = file_of(files, metadata, tensors)
    message = error_of(c.post(f"/api/blobs/{sha(data)}", content=data), 400, str(models), str(files))
    assert message.startswith("not a valid GGUF model: ") and expected in message, message
    assert_not_held(c, models, data)


def test_the_small_llama_is_served(served):
    c, models, files = served
    data = file_of(files)
    assert c.post(f"/api/blobs/{sha(data)}", content=data).status_code == 201
    r = c.post("/api/create", json={"model": "small", "files": {"m.gguf": sha(data)}, "stream": False})
    assert r.status_code == 200, r.text
    for path, body in (("/api/generate", {"prompt": "hi"}),
                       ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]})):
        r = c.post(path, json={"model": "small", "stream": False, "options": {"num_predict": 2}, **body})
        assert r.status_code == 200 and r.json()["done"], r.text
    assert c.request("DELETE", "/api/delete", json={"model": "small"}).status_code == 200
    assert_not_held(c, models, data)


HOSTILE_TEMPLATES = {
    "recursion without end": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "recursion with fan-out": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                              "{{ f(60) }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "a gigabyte": "{{ 'x' * 1000000000 }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "python internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
}


def test_a_hostile_chat_template_is_a_400_and_the_server_stays_up(served):
    c, models, files = served
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i, (name, template) in enumerate(HOSTILE_TEMPLATES.items()):
        data = file_of(files, {"tokenizer.chat_template": template, "general.name": f"t{i}"})
        assert c.post(f"/api/blobs/{sha(data)}", content=data).status_code == 201, name
        model = f"hostile-template-{i}"
        r = c.post("/api/create", json={"model": model, "files": {"m.gguf": sha(data)}, "stream": False})
        assert r.status_code == 200, (name, r.text)
        chat = [{"role": "user", "content": "hi"}]
        for path, body in (("/api/chat", {"messages": chat, "options": {"num_predict": 2}}),
                           ("/api/generate", {"prompt": "hi", "options": {"num_predict": 2}}),
                           ("/v1/chat/completions", {"messages": chat, "max_tokens": 2})):
            r = c.post(path, json={"model": model, "stream": False, **body})
            assert "chat template" in error_of(r, 400, str(models)), (name, path)
        # Raw completion does not use the template.
        r = c.post("/api/generate", json={"model": model, "prompt": "hi", "raw": True, "stream": False,
                                          "options": {"num_predict": 2}})
        assert r.status_code == 200, (name, r.text)
        assert_healthy(c)
        assert c.request("DELETE", "/api/delete", json={"model": model}).status_code == 200
        assert_not_held(c, models, data)
    # ru_maxrss is in KiB: the gigabyte and the doubling were never built.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20


def test_a_hostile_template_given_to_create_is_held_to_the_same_budget(served):
    c, models, _ = served
    body = {"model": "tmpl", "from": "tiny-a", "template": HOSTILE_TEMPLATES["nested loops"], "stream": False}
    assert c.post("/api/create", json=body).status_code == 200
    r = c.post("/api/chat", json={"model": "tmpl", "messages": [{"role": "user", "content": "hi"}], "stream": False})
    assert "too many steps" in error_of(r, 400, str(models))
    assert_healthy(c)
    assert c.request("DELETE", "/api/delete", json={"model": "tmpl"}).status_code == 200
    # A template too long to compile cheaply (4 MB took 60 s and 4.6 GB to compile) is refused at create.
    body["template"] = "{{ messages }}" * 300_000
    assert "limit is" in error_of(c.post("/api/create", json=body), 400, str(models))


def test_a_file_that_fails_to_load_is_a_422_without_paths(served):
    # The structure and hyperparameters pass, but the merges are not pairs: the tokenizer cannot be built.
    c, models, files = served
    data = file_of(files, {"tokenizer.ggml.merges": (["a b c"] * 3, VT.ARRAY)})
    assert c.post(f"/api/blobs/{sha(data)}", content=data).status_code == 201
    assert c.post("/api/create", json={"model": "bad-merges", "files": {"m.gguf": sha(data)},
                                       "stream": False}).status_code == 200
    for path, body in (("/api/generate", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = c.post(path, json={"model": "bad-merges", "stream": False, **body})
        message = error_of(r, 422, str(models), "sha256-")
        assert message.startswith("model 'bad-merges' could not be loaded: the tokenizer in the model file is "
                                  "malformed"), message
    assert_healthy(c)
    assert c.request("DELETE", "/api/delete", json={"model": "bad-merges"}).status_code == 200
    assert_not_held(c, models, data)
