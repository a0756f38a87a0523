"""LoRA adapters over Ollama's API, as its own client sends them: the adapter pushed as a blob, /api/create
with `adapters`, the model answering with the merged weights (greedy tokens the same as a file holding
the base's weights plus the adapter's update, loaded directly), /api/show's Modelfile naming the
adapter, /api/delete taking the blobs with it; a Modelfile's ADAPTER over HTTP names a blob, never a
server file; `tokenmill create` pushes a Modelfile's ADAPTER file, or imports it without a server."""
from __future__ import annotations

import hashlib

import httpx
import pytest

from test_blobs import assert_clean_error, leftovers, served  # noqa: F401 (served: a fixture, tiny-a's server)
from tiny_lora import write_lora, write_updated
from tokenmill.cli import main
from tokenmill.engine import LLM, SamplingParams

PROMPT = "the quick brown fox"


def sha(path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def adapter(store, tmp_path):
    (tmp_path / "client").mkdir()
    updates = write_lora(tmp_path / "client" / "tune.gguf", store / "tiny-a.gguf", rank=4, size=0.4)
    reference = write_updated(tmp_path / "updated.gguf", store / "tiny-a.gguf", updates)
    return tmp_path / "client" / "tune.gguf", reference


def greedy_of(path, prompt_ids: list[int], n: int) -> list[int]:
    """What the model in `path` decodes greedily after `prompt_ids`, loaded directly (no server)."""
    llm = LLM(str(path))
    return llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].token_ids


def test_the_ollama_client_creates_a_model_with_an_adapter(served, store, adapter, tmp_path):
    import ollama

    c, _ = served
    lora, reference = adapter
    client = ollama.Client(host=str(c.base_url))
    digest = client.create_blob(lora)
    assert digest == sha(lora)
    client.create("tuned", from_="tiny-a", adapters={"tune.gguf": digest}, system="Be brief.")
    options = {"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0}  # greedy, as LLM decodes
    tuned = c.post("/api/generate", json={"model": "tuned", "prompt": PROMPT, "raw": True, "stream": False,
                                          "options": options}).json()
    plain = c.post("/api/generate", json={"model": "tiny-a", "prompt": PROMPT, "raw": True, "stream": False,
                                          "options": options}).json()
    prompt_ids = tuned["context"][:-tuned["eval_count"]]
    assert tuned["context"][len(prompt_ids):] == greedy_of(reference, prompt_ids, tuned["eval_count"])
    assert tuned["response"] != plain["response"]  # the adapter changed what the model says
    shown = c.post("/api/show", json={"model": "tuned"}).json()
    assert f"FROM tiny-a\nADAPTER {digest}\n" in shown["modelfile"] and shown["system"] == "Be brief."
    assert str(store) not in str(shown)
    # The adapter alone is no model, and a request cannot name it as one.
    r = c.post("/api/create", json={"model": "nope", "from": digest, "stream": False})
    assert "LoRA adapter, not a model" in assert_clean_error(r, 400, str(store))
    c.request("DELETE", "/api/delete", json={"model": "tuned"}).raise_for_status()
    assert c.head(f"/api/blobs/{digest}").status_code == 404 and leftovers(store) == []


def test_adapters_that_cannot_be_used_are_400s_naming_no_path(served, store, adapter, tmp_path):
    c, _ = served
    lora, _ = adapter
    digest = sha(lora)
    cases = [({"adapters": {"a.gguf": digest}}, "not found"),  # not pushed yet
             ({"adapters": {"a.gguf": "/etc/passwd"}}, "digest"),
             ({"adapters": ["x"]}, "must be an object"),
             ({"adapters": {str(i): digest for i in range(9)}}, "at most 8"),
             ({"modelfile": f"FROM tiny-a\nADAPTER {lora}\n"}, "not a file on the server"),
             ({"modelfile": "FROM tiny-a\nADAPTER ../../etc/passwd\n"}, "not a file on the server")]
    for body, word in cases:
        base = {} if "modelfile" in body else {"from": "tiny-a"}
        r = c.post("/api/create", json={"model": "x", "stream": False, **base, **body})
        assert word in assert_clean_error(r, 400, str(tmp_path), str(store), "root:"), (body, r.text)
    # An adapter for another shape of model: pushed, then refused when applied, leaving nothing new.
    assert c.post(f"/api/blobs/{digest}", content=lora.read_bytes()).status_code == 201
    wide = tmp_path / "wide-lora.gguf"
    from tiny_model import TinyLlamaSpec, write_tiny_llama

    write_lora(wide, write_tiny_llama(tmp_path / "wide.gguf", TinyLlamaSpec(dim=96, ffn_dim=160)),
               ("blk.0.attn_q.weight",))
    assert c.post(f"/api/blobs/{sha(wide)}", content=wide.read_bytes()).status_code == 201
    before = leftovers(store)
    r = c.post("/api/create", json={"model": "x", "from": "tiny-a", "stream": False,
                                    "adapters": {"ok.gguf": digest, "wide.gguf": sha(wide)}})
    message = assert_clean_error(r, 400, str(tmp_path), str(store))
    assert "adapter 2" in message and "96 x 96" in message
    assert leftovers(store) == before
    assert c.post("/api/show", json={"model": "x"}).status_code == 404


def test_cli_create_pushes_a_modelfiles_adapter(served, store, adapter, monkeypatch, capsys):
    c, _ = served
    lora, reference = adapter
    monkeypatch.setenv("TOKENMILL_HOST", f"127.0.0.1:{c.base_url.port}")
    modelfile = lora.parent / "Modelfile"
    modelfile.write_text("FROM tiny-a\nADAPTER ./tune.gguf\nPARAMETER temperature 0\nPARAMETER repeat_penalty 1\n")
    monkeypatch.chdir("/")  # ADAPTER is relative to the Modelfile's folder
    assert main(["create", "cli-tuned", "-f", str(modelfile)]) == 0
    assert capsys.readouterr().out.strip() == "success"
    assert c.head(f"/api/blobs/{sha(lora)}").status_code == 200
    r = c.post("/api/generate", json={"model": "cli-tuned", "prompt": PROMPT, "raw": True, "stream": False,
                                      "options": {"num_predict": 6}}).json()
    prompt_ids = r["context"][:-r["eval_count"]]
    assert r["context"][len(prompt_ids):] == greedy_of(reference, prompt_ids, r["eval_count"])
    modelfile.write_text("FROM tiny-a\nADAPTER ./missing.gguf\n")
    assert main(["create", "x", "-f", str(modelfile)]) == 1
    assert "ADAPTER ./missing.gguf: no such file" in capsys.readouterr().err


def test_cli_create_without_a_server_imports_the_adapter(store, adapter, nobody_listens, capsys):
    lora, reference = adapter
    (lora.parent / "Modelfile").write_text(f"FROM tiny-a\nADAPTER {lora}\n")
    assert main(["create", "local-tuned", "-f", str(lora.parent / "Modelfile")]) == 0
    assert main(["show", "local-tuned", "--modelfile"]) == 0
    assert f"ADAPTER {sha(lora)}" in capsys.readouterr().out
    assert main(["list"]) == 0  # listed with its merged weights' size and types
    [row] = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("local-tuned ")]
    assert row[3:5] == ["llama", "F32"], row
    assert main(["rm", "local-tuned"]) == 0
    assert leftovers(store) == []


def served_process(*argv: str):
    """`tokenmill serve ARGV...` in a subprocess, once /health answers: (process, client)."""
    import os
    import subprocess
    import sys
    import time

    from test_serve import free_port

    port = free_port()
    env = {**os.environ, "TOKENMILL_COMPILE": "false", "TOKENMILL_KV_SIZE": "2048"}
    cmd = [sys.executable, "-c", "import sys; from tokenmill.cli import main; sys.exit(main(sys.argv[1:]))",
           "serve", *argv, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    deadline = time.monotonic() + 60
    while True:
        try:
            if c.get("/health").status_code == 200:
                return proc, c
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(proc.stderr.read() if proc.wait() is not None else "")
        time.sleep(0.1)


def greedy_answer(c: httpx.Client, model: str) -> tuple[list[int], list[int]]:
    r = c.post("/api/generate", json={"model": model, "prompt": PROMPT, "raw": True, "stream": False,
                                      "options": {"temperature": 0, "num_predict": 6, "repeat_penalty": 1}}).json()
    prompt_ids = r["context"][:-r["eval_count"]]
    return prompt_ids, r["context"][len(prompt_ids):]


def test_serve_lora_modules_serves_each_adapter_as_a_model(store, adapter, tmp_path):
    """vLLM's --lora-modules NAME=FILE: the served model with the adapter merged in, under NAME."""
    lora, reference = adapter
    proc, c = served_process("tiny-a", "--lora-modules", f"tuned={lora}")
    try:
        assert "tuned" in {m["id"] for m in c.get("/v1/models").json()["data"]}
        prompt_ids, answer = greedy_answer(c, "tuned")
        assert answer == greedy_of(reference, prompt_ids, len(answer))
    finally:
        c.close()
        proc.terminate()
        proc.wait(30)


def test_serve_starts_with_a_created_model(store, adapter):
    """`tokenmill serve NAME` for a model `create` made (it said "unknown model"): its weights load at
    start, under its name, and its requests get its profile."""
    from tokenmill.store.blobs import import_file
    from tokenmill.store.derived import Profile, save_derived

    lora, reference = adapter
    adapter_digest = f"sha256:{import_file(lora, kind='adapter')}"
    save_derived("tuned", "tiny-a", Profile(parameters={"num_predict": 2}), (adapter_digest,))
    proc, c = served_process("tuned")
    try:
        assert [m["name"] for m in c.get("/api/ps").json()["models"]] == ["tuned"]
        prompt_ids, answer = greedy_answer(c, "tuned")
        assert answer == greedy_of(reference, prompt_ids, len(answer))
        r = c.post("/api/generate", json={"model": "tuned", "prompt": PROMPT, "raw": True, "stream": False}).json()
        assert r["eval_count"] <= 2  # its PARAMETER num_predict
        assert [m["name"] for m in c.get("/api/ps").json()["models"]] == ["tuned"]  # served by the one loaded
    finally:
        c.close()
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("modules,words", [("tuned", "is not NAME=FILE"), ("tuned=", "is not NAME=FILE"),
                                           ("tuned=/no/such.gguf", "no such file"),
                                           ("tuned={base}", "is a model, not a LoRA adapter")])
def test_serve_refuses_lora_modules_it_cannot_make(store, modules, words, capsys):
    import argparse

    from test_serve import free_port
    from tokenmill.server.commands import cmd_serve

    modules = modules.format(base=store / "tiny-b.gguf")
    code = cmd_serve(argparse.Namespace(model="tiny-a", host="127.0.0.1", port=free_port(), lora_modules=modules))
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and words in err and "--lora-modules" in err, err
    assert leftovers(store) == []


def test_a_restart_with_the_same_lora_modules_does_not_merge_again(store, adapter, monkeypatch):
    import argparse

    from tokenmill.config import load_config
    from tokenmill.server.commands import make_lora_models
    from tokenmill.store.derived import find_derived

    lora, _ = adapter
    settings = load_config(argparse.Namespace(model="tiny-a", lora_modules=f"tuned={lora}"))
    assert make_lora_models(settings) is None
    first = find_derived("tuned")
    assert make_lora_models(settings) is None
    assert find_derived("tuned") == first  # the same record, not made again
    monkeypatch.setattr("tokenmill.store.adapters.merged_blob", lambda *a: pytest.fail("merged again"))
    assert make_lora_models(settings) is None


def test_run_in_process_takes_a_created_models_weights_and_profile(store, adapter, nobody_listens, capsys):
    """`tokenmill run NAME` without a server: the adapted weights, SYSTEM opening the conversation and
    PARAMETERs under the run's own flags (it said "unknown model" for any created model)."""
    lora, _ = adapter
    (lora.parent / "Modelfile").write_text(f"FROM tiny-a\nADAPTER {lora}\nSYSTEM \"\"\"Answer in French.\"\"\"\n"
                                           "PARAMETER num_predict 3\nPARAMETER temperature 0\n")
    assert main(["create", "local-tuned", "-f", str(lora.parent / "Modelfile")]) == 0
    capsys.readouterr()

    def run(*argv: str) -> dict[str, int]:
        assert main(["run", *argv, "--verbose"]) == 0
        err = capsys.readouterr().err
        counts = {line.split(":")[0].strip(): int(line.split(":")[1].split()[0]) for line in err.splitlines()
                  if line.startswith(("prompt eval count", "eval count"))}
        assert "in-process" in err and len(counts) == 2, err
        return counts

    tuned, plain = run("local-tuned", "hello"), run("tiny-a", "hello", "--max-tokens", "3")
    assert tuned["eval count"] == 3 and tuned["prompt eval count"] > plain["prompt eval count"]  # its SYSTEM
    assert run("local-tuned", "hello", "--max-tokens", "2")["eval count"] == 2  # a flag over its PARAMETER


def test_the_llm_class_takes_a_created_models_name(store, adapter):
    from tokenmill.store.blobs import import_file
    from tokenmill.store.derived import Profile, save_derived

    lora, reference = adapter
    save_derived("tuned", "tiny-a", Profile(), (f"sha256:{import_file(lora, kind='adapter')}",))
    ids = list(range(40, 60))
    assert greedy_of("tuned", ids, 10) == greedy_of(reference, ids, 10) != greedy_of("tiny-a", ids, 10)
