"""Hypothesis against the doors a hostile client knocks on: model names (Unicode, lone surrogates,
control characters, NUL, very long, traversal, absolute and Windows paths, percent-encoding) on every
route that takes one, mutated /api/create bodies (`from`, Modelfile FROM, `files`, `quantize`, wrong
types), Host headers, and a few mutated blob uploads. Whatever is sent: no 5xx, every error a JSON body, no server path (the
store's directory) or server file bytes in any answer, and a refused request leaves the store as
it was. TOKENMILL_FUZZ_EXAMPLES scales the examples (more for a longer run)."""
from __future__ import annotations

import json
import os
import urllib.parse
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_helpers import store_server, wait_idle
from tokenmill.server.access import host_name, is_loopback_host
from tokenmill.store.catalog import StoreError, find_spec
from tokenmill.store.derived import normalize_name
from tokenmill.store.model_name import check_model_name

SCALE = int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", "150")) / 150
INSTALLED = {"tiny-a", "tiny-b"}


def fuzz_settings(examples: int):
    return settings(max_examples=max(10, int(examples * SCALE)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def _passwd_line() -> str | None:
    try:
        return Path("/etc/passwd").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None


PASSWD = _passwd_line()

HOSTILE_NAMES = [
    "../../etc/passwd", "/etc/passwd", "..\\..\\windows\\win.ini", "C:\\Windows\\System32\\config\\SAM",
    "%2e%2e/%2e%2e/etc/passwd", "%2e%2e%2fetc%2fpasswd", "....//....//etc/passwd", "~/.ssh/id_rsa", "~root",
    "/proc/self/environ", "file:///etc/passwd", "\\\\server\\share\\x.gguf", "tiny-a.gguf", "./tiny-a",
    "tiny-a/../../x", "\x00", "tiny-a\x00.gguf", "\ud800", "\udfff\ud800", "a" * 300, "a" * 201, "a" * 5000,
    "\u202etxt.gguf", "\ufeffsmollm2", "smollm2\n", " smollm2", "CON", "nul:", "a/b/c/d", "tiny-a", "smollm2",
]

# Lone surrogates on purpose: hypothesis' text() leaves category Cs out.
SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
ANY_CHAR = st.one_of(st.characters(), SURROGATE, st.sampled_from(list("/\\.:%~\x00\n\t-_@")))
PART = st.text(alphabet=st.sampled_from("abcXYZ019._-"), min_size=1, max_size=12)
NAMEISH = st.builds(lambda parts, seps: "".join(p + s for p, s in zip(parts, seps)),
                    st.lists(PART, min_size=1, max_size=5), st.lists(st.sampled_from(["/", ":", "..", "/..", ""]),
                                                                   min_size=5, max_size=5))
NAMES = st.one_of(
    st.sampled_from(HOSTILE_NAMES),
    st.text(ANY_CHAR, max_size=40),
    NAMEISH,
    st.integers(150, 600).map(lambda n: "m" * n),
    st.builds(lambda a, b: a + b, st.sampled_from(HOSTILE_NAMES), st.text(ANY_CHAR, max_size=8)),
)
# Wrong types where a name goes.
NOT_STRINGS = st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.booleans(),
                        st.lists(st.text(max_size=5), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                                      max_size=2))

# (method, path, body builder) for every route that takes a name; `n` is the fuzzed value.
NAME_ROUTES = [
    ("POST", "/api/generate", lambda n: {"model": n, "prompt": "x", "stream": False, "options": {"num_predict": 1}}),
    ("POST", "/api/generate", lambda n: {"name": n, "prompt": "", "keep_alive": 0}),
    ("POST", "/api/chat", lambda n: {"model": n, "messages": [{"role": "user", "content": "x"}], "stream": False,
                                     "options": {"num_predict": 1}}),
    ("POST", "/api/embed", lambda n: {"model": n, "input": "x"}),
    ("POST", "/api/embeddings", lambda n: {"model": n, "prompt": "x"}),
    ("POST", "/api/show", lambda n: {"model": n}),
    ("DELETE", "/api/delete", lambda n: {"model": n}),
    ("POST", "/api/copy", lambda n: {"source": n, "destination": "fuzz-copy"}),
    ("POST", "/api/copy", lambda n: {"source": "tiny-a", "destination": n}),
    ("POST", "/api/create", lambda n: {"model": n, "from": "tiny-a", "stream": False}),
    ("POST", "/api/create", lambda n: {"model": "fuzz-made", "from": n, "stream": False}),
    ("POST", "/api/create", lambda n: {"model": "fuzz-made", "modelfile": f"FROM {n}\n", "stream": False}),
    ("POST", "/api/pull", lambda n: {"model": n, "stream": False}),
    ("POST", "/v1/chat/completions", lambda n: {"model": n, "messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 1}),
    ("POST", "/v1/completions", lambda n: {"model": n, "prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/embeddings", lambda n: {"model": n, "input": "x"}),
    ("POST", "/completion", lambda n: {"model": n, "prompt": "x", "n_predict": 1}),
    ("POST", "/embedding", lambda n: {"model": n, "content": "x"}),
    ("POST", "/tokenize", lambda n: {"model": n, "content": "x"}),
    ("POST", "/detokenize", lambda n: {"model": n, "tokens": [1]}),
    ("POST", "/load", lambda n: {"model": n}),
]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """A tiny-a server over its own store: (client, models dir, host)."""
    with store_server(tmp_path_factory.mktemp("fuzz-names-home"), extra_models=1, max_tokens=2) as served:
        yield served


def listing(models: Path) -> dict[str, int]:
    """Every file in the store but the manifests beside a GGUF (rewritten whenever one is described)
    and the blob store's lock file (made on first use)."""
    return {str(p.relative_to(models)): p.stat().st_size for p in sorted(models.rglob("*"))
            if p.is_file() and not p.name.endswith(".gguf.json") and p.name != ".lock"}


def send(client: httpx.Client, method: str, path: str, body) -> httpx.Response:
    # json.dumps escapes lone surrogates (\ud800) as a hostile client would send them.
    return client.request(method, path, content=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"})


def check_answer(r: httpx.Response, models: Path, where) -> None:
    assert r.status_code < 500, (where, r.status_code, r.text[:300])
    if r.status_code >= 400:
        body = r.json()
        assert isinstance(body, dict) and body.get("error"), (where, r.text[:300])
    text = r.text
    assert str(models.parent) not in text and str(models.resolve().parent) not in text, (where, text[:300])
    if PASSWD:
        assert PASSWD not in text, where


def tidy(client: httpx.Client, models: Path, before: dict[str, int]) -> None:
    """Remove what a successful request legitimately made (a copy, a created model), so the next
    example starts from the same store."""
    derived = models / "derived"
    for p in derived.glob("*.json") if derived.is_dir() else ():
        if str(p.relative_to(models)) not in before:
            p.unlink()


def _acts_on_the_store(path: str, name: str) -> bool:
    """Requests that would succeed at something other than probing: deleting the store's own models,
    switching the served model (/load), downloading a catalog model from PyPI (/api/pull, /load)."""
    if path not in ("/api/delete", "/load", "/api/pull"):
        return False
    try:
        check_model_name(name)
    except StoreError:
        return False  # a refused name is exactly what this test is for
    return path != "/api/delete" or normalize_name(name) in INSTALLED or find_spec(name) is not None


@given(route=st.sampled_from(NAME_ROUTES), name=st.one_of(NAMES, NOT_STRINGS))
@fuzz_settings(300)
def test_fuzzed_model_names_on_every_route(fuzzed, route, name):
    client, models, _ = fuzzed
    method, path, build = route
    if isinstance(name, str) and _acts_on_the_store(path, name):
        return
    before = listing(models)
    r = send(client, method, path, build(name))
    check_answer(r, models, (method, path, repr(name)[:80]))
    if r.status_code >= 400:
        assert listing(models) == before, (path, repr(name)[:80])
    tidy(client, models, before)


@given(name=NAMES.filter(lambda n: "\x00" not in n))
@fuzz_settings(60)
def test_fuzzed_names_in_the_openai_model_path(fuzzed, name):
    client, models, _ = fuzzed
    try:
        quoted = urllib.parse.quote(name, safe="")
    except UnicodeEncodeError:  # a lone surrogate has no UTF-8 bytes to percent-encode: send raw bytes
        quoted = urllib.parse.quote(name.encode("utf-8", "surrogatepass"), safe="")
    r = client.get("/v1/models/" + quoted)
    check_answer(r, models, ("/v1/models", repr(name)[:80]))


DIGEST = st.one_of(st.builds(lambda h: "sha256:" + h, st.text("0123456789abcdef", min_size=64, max_size=64)),
                   st.sampled_from(["sha256:../../etc/passwd", "sha256-" + "0" * 64, "sha256:", "md5:abc",
                                    "sha256:" + "g" * 64, "/etc/passwd", "../blobs/x"]), NAMES)
FILES = st.dictionaries(st.one_of(NAMES, st.sampled_from(["model.gguf", "../../x.gguf", "/etc/passwd", "a\x00.gguf",
                                                          "", ".", "blobs/../../x"])),
                        st.one_of(DIGEST, NOT_STRINGS), max_size=3)
MODELFILE_LINES = st.one_of(
    st.builds(lambda n: f"FROM {n}", NAMES.filter(lambda n: "\n" not in n)),
    st.sampled_from(["FROM /etc/passwd", "FROM ../../etc/passwd", "FROM ./model.gguf", "FROM ~/x.gguf",
                     "FROM tiny-a", "PARAMETER temperature 0.1", "PARAMETER num_ctx -5", "PARAMETER nope 1",
                     'SYSTEM """x"""', "TEMPLATE {{ .Prompt }}", "MESSAGE user hi", "ADAPTER /etc/passwd",
                     "LICENSE x", "FROM", "\x00", "FROM tiny-a\x00"]),
    st.text(ANY_CHAR, max_size=30))
CREATE_BODIES = st.fixed_dictionaries(
    {"model": st.one_of(st.just("fuzz-made"), NAMES)},
    optional={
        "from": st.one_of(st.sampled_from(["tiny-a", "/etc/passwd", "../../etc/passwd", str(Path.home()), "./x.gguf"]),
                          DIGEST, NOT_STRINGS),
        "modelfile": st.one_of(st.lists(MODELFILE_LINES, max_size=5).map("\n".join), NOT_STRINGS),
        "files": st.one_of(FILES, NOT_STRINGS),
        "adapters": st.one_of(FILES, NOT_STRINGS),
        "quantize": st.one_of(st.sampled_from(["q4_0", "q8_0", "Q4_K_M", "", "../x"]), NOT_STRINGS),
        "system": st.one_of(st.text(ANY_CHAR, max_size=20), NOT_STRINGS),
        "template": st.one_of(st.sampled_from(["{{ .Prompt }}", "{% for %}", "{{"]), NOT_STRINGS),
        "parameters": st.one_of(st.dictionaries(st.sampled_from(["temperature", "num_ctx", "stop", "nope", ""]),
                                                st.one_of(st.integers(), st.text(max_size=5), NOT_STRINGS),
                                                max_size=3), NOT_STRINGS),
        "messages": st.one_of(st.lists(st.dictionaries(st.sampled_from(["role", "content"]),
                                                       st.one_of(st.text(max_size=5), NOT_STRINGS)), max_size=2),
                              NOT_STRINGS),
        "stream": st.one_of(st.just(False), NOT_STRINGS),
        "license": NOT_STRINGS,
        "path": st.sampled_from(["/etc/passwd", "../x", "Modelfile"]),
    })


@given(body=CREATE_BODIES)
@fuzz_settings(200)
def test_fuzzed_create_bodies(fuzzed, body):
    client, models, _ = fuzzed
    before = listing(models)
    r = send(client, "POST", "/api/create", body)
    check_answer(r, models, ("/api/create", repr(body)[:200]))
    # A stream that began (200) may still end in an error line: nothing of it may be left behind.
    failed = r.status_code >= 400 or any("error" in json.loads(line) for line in r.text.splitlines()
                                         if line.startswith("{"))
    if failed:
        assert listing(models) == before, repr(body)[:200]
    tidy(client, models, before)


HOST_HEADERS = st.one_of(
    st.sampled_from(["localhost", "127.0.0.1:11434", "[::1]", "evil.example", "127.0.0.1.evil.example",
                     "localhost.evil.example", "0.0.0.0", "[::]", "2130706433", "0x7f.1", "127.1", "::1",
                     "[::1", "localhost:", ":11434", "[]", "...", "LOCALHOST.", "a.localhost", "x" * 300]),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40))


@given(host_header=HOST_HEADERS, path=st.sampled_from(["/api/version", "/api/tags", "/v1/models", "/health"]))
@fuzz_settings(150)
def test_fuzzed_host_headers(fuzzed, host_header, path):
    client, models, _ = fuzzed
    r = client.get(path, headers={"Host": host_header})
    check_answer(r, models, (path, host_header))
    allowed = is_loopback_host(host_name(host_header))
    assert r.status_code == 403 if not allowed else r.status_code != 403, (host_header, r.status_code)


def _blob_body(kind: str, data: bytes, tiny: bytes) -> bytes:
    return {"random": data, "truncated": tiny[:max(1, len(data) * 97)], "tail-cut": tiny[:-max(1, len(data))],
            "gguf-magic": b"GGUF" + data, "empty": b""}[kind]


@given(kind=st.sampled_from(["random", "truncated", "tail-cut", "gguf-magic", "empty"]),
       data=st.binary(max_size=64),
       digest=st.one_of(st.just("right"), st.just("wrong"), st.sampled_from(HOSTILE_NAMES[:14]),
                        st.builds(lambda h: "sha256:" + h, st.text("0123456789abcdefABCDEF", max_size=70))))
@fuzz_settings(60)
def test_fuzzed_blob_uploads(fuzzed, kind, data, digest):
    """A few mutated uploads (the blob tests proper are tests/server/test_blobs.py): a wrong or
    malformed digest, a truncated or cut model, not a GGUF at all: 4xx, and nothing stays."""
    import hashlib

    client, models, _ = fuzzed
    body = _blob_body(kind, data, (models / "tiny-a.gguf").read_bytes())
    named = {"right": "sha256:" + hashlib.sha256(body).hexdigest(),
             "wrong": "sha256:" + hashlib.sha256(body + b"x").hexdigest()}.get(digest, digest)
    try:
        quoted = urllib.parse.quote(named, safe=":")
    except UnicodeEncodeError:
        quoted = urllib.parse.quote(named.encode("utf-8", "surrogatepass"), safe=":")
    before = listing(models)
    r = client.post("/api/blobs/" + quoted, content=body)
    check_answer(r, models, ("/api/blobs", kind, named[:80]))
    assert r.status_code >= 400, (kind, named[:80])  # none of these is a whole, valid model
    assert listing(models) == before, (kind, named[:80])
    r = client.head("/api/blobs/" + quoted)
    assert r.status_code in (400, 404), (named[:80], r.status_code)


def test_the_server_is_whole_after_the_fuzzing(fuzzed):
    client, models, host = fuzzed
    r = client.post("/api/generate", json={"model": "tiny-a", "prompt": "hi", "stream": False})
    assert r.status_code == 200 and r.json()["done"]
    assert (models / "tiny-a.gguf").is_file() and (models / "tiny-b.gguf").is_file()
    wait_idle(host, timeout=30)
