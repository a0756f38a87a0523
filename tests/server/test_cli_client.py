"""The CLI as a client, as Ollama's is: `run` goes through a running server when one answers (the
server's request counter proves the answer came from it) and runs in-process when none does; `ps`,
`stop`, `cp`, `rm`, `create` and `show` act through the server, or on the store without one."""
from __future__ import annotations

import hashlib
import math
import re
import sys

import httpx
import pytest

from server_helpers import Terminal, start_server
from tokenmill.cli import main


def finished_requests(c: httpx.Client) -> float:
    text = c.get("/metrics").text
    return sum(float(v) for v in re.findall(r'^vllm:request_success_total\{[^}]*\} (\S+)$', text, re.M))


def test_run_ps_stop_go_through_a_running_server(store, monkeypatch, capsys):
    server, host = start_server("tiny-a", kv_size=2048)
    monkeypatch.setenv("TOKENMILL_HOST", f"127.0.0.1:{server.port}")
    try:
        assert host.wait_ready(30)
        with httpx.Client(base_url=server.url, timeout=30) as c:
            before = finished_requests(c)
            assert main(["run", "tiny-a", "hello", "--max-tokens", "3"]) == 0
            out, err = capsys.readouterr()
            assert f"using the server at http://127.0.0.1:{server.port}" in err and out.strip()
            assert finished_requests(c) == before + 1
            assert main(["run", "tiny-b", "hello", "--max-tokens", "2"]) == 0  # loads tiny-b on the server
            capsys.readouterr()
            assert main(["ps"]) == 0
            out = capsys.readouterr().out
            assert out.startswith("NAME") and "tiny-a" in out and "tiny-b" in out and "Forever" in out
            assert main(["stop", "tiny-b"]) == 0
            deadline_ok = any(_gone(c, "tiny-b") for _ in _tries())
            assert deadline_ok
            assert main(["run", "nope", "hi"]) == 1
            assert 'model "nope" not found' in capsys.readouterr().err
    finally:
        server.stop()


def _tries(n: int = 100):
    import time

    for _ in range(n):
        yield
        time.sleep(0.05)


def _gone(c: httpx.Client, name: str) -> bool:
    return name not in {m["name"] for m in c.get("/api/ps").json()["models"]}


def test_run_in_process_and_store_commands_without_a_server(store, nobody_listens, capsys, tmp_path):
    assert main(["run", "tiny-a", "hello", "--max-tokens", "3", "--dtype", "fp32"]) == 0
    out, err = capsys.readouterr()
    assert "in-process (no server answers at" in err and out.strip()
    assert main(["ps"]) == 1 and "no tokenmill server answers" in capsys.readouterr().err
    assert main(["cp", "tiny-a", "mine"]) == 0 and "copied 'tiny-a' to 'mine'" in capsys.readouterr().out
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text('FROM mine\nSYSTEM """Answer in French."""\nPARAMETER temperature 0.2\n')
    assert main(["create", "french", "-f", str(modelfile)]) == 0
    capsys.readouterr()
    assert main(["show", "french"]) == 0
    out = capsys.readouterr().out
    assert "Answer in French." in out and "temperature 0.2" in out and "llama" in out
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert main(["rm", "tiny-a"]) == 1 and "base of" in capsys.readouterr().err  # mine and french use it
    assert main(["rm", "french", "mine"]) == 0
    assert main(["rm", "tiny-a"]) == 0 and not (store / "tiny-a.gguf").exists()
    assert "tiny-b" in listed


def test_show_without_a_server_takes_a_catalog_alias_and_counts_parameters(store, nobody_listens, monkeypatch,
                                                                           capsys):
    from tokenmill.gguf import open_gguf
    from tokenmill.store import KNOWN_MODELS, ModelSpec

    # tiny-a.gguf as a catalog model "tiny:1m", alias "tiny": `tokenmill list` shows the canonical name.
    data = (store / "tiny-a.gguf").read_bytes()
    spec = ModelSpec("tiny:1m", ("tiny",), "tiny-a.gguf", (), hashlib.sha256(data).hexdigest(), len(data))
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    assert main(["list"]) == 0
    assert "tiny:1m" in capsys.readouterr().out
    assert main(["show", "tiny"]) == 0
    out = capsys.readouterr().out
    count = sum(math.prod(t.shape) for t in open_gguf(store / "tiny-a.gguf").tensors.values())
    assert count > 1000
    expected = f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count / 1e3:.1f}K"
    assert re.search(rf"parameters\s+{re.escape(expected.replace('.0', ''))}\n", out), out
    assert re.search(r"Capabilities\s*\n\s+completion\s*\n", out), out  # as `ollama show` lists them
    assert main(["show", "nope"]) == 1 and 'model "nope" not found' in capsys.readouterr().err


def test_run_through_a_server_sends_only_the_options_given(monkeypatch, capsys):
    # A model created with PARAMETER num_predict/temperature keeps them: `run` without flags sends no
    # options (as Ollama's run), and a flag overrides only its own option.
    import tokenmill.run as run
    import tokenmill.run_chats as run_chats

    bodies = []

    def fake_stream(base, path, body):
        bodies.append((path, body))
        yield {"message": {"content": "arr"}}

    monkeypatch.setattr(run, "answers", lambda base: True)
    monkeypatch.setattr(run_chats, "stream", fake_stream)
    assert main(["run", "pirate", "hi"]) == 0
    assert main(["run", "pirate", "hi", "--max-tokens", "5"]) == 0
    assert main(["run", "pirate", "hi", "--temperature", "0"]) == 0
    assert "arr" in capsys.readouterr().out
    assert [(p, b["options"]) for p, b in bodies] == [
        ("/api/chat", {}), ("/api/chat", {"num_predict": 5}), ("/api/chat", {"temperature": 0.0})]
    assert not any("format" in b or "keep_alive" in b for _, b in bodies)
    assert main(["run", "pirate", "hi", "--format", "json", "--keepalive", "5m"]) == 0
    assert bodies[-1][1]["format"] == "json" and bodies[-1][1]["keep_alive"] == "5m"


@pytest.mark.parametrize("value,words", [
    ("127.0.0.1:abc", "TOKENMILL_HOST: invalid port in '127.0.0.1:abc'"),
    ("127.0.0.1:99999", "TOKENMILL_HOST: port out of range in '127.0.0.1:99999'"),
    ("127.0.0.1:11600/x", "TOKENMILL_HOST: invalid port in '127.0.0.1:11600/x'"),
    (":::::", "TOKENMILL_HOST: invalid host in ':::::'"),
])
@pytest.mark.parametrize("argv", [["ps"], ["show", "x"], ["stop", "x"], ["rm", "x"], ["cp", "x", "y"],
                                  ["run", "x", "hi"]])
def test_a_bad_server_address_is_one_line_for_every_command(monkeypatch, capsys, value, words, argv):
    monkeypatch.setenv("TOKENMILL_HOST", value)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == f"error: {words}\n"


def test_a_bad_server_flag_names_the_flag(capsys):
    assert main(["run", "x", "hi", "--server", "1:2:3"]) == 1
    assert capsys.readouterr().err == "error: --server: invalid host in '1:2:3'\n"


def test_a_server_that_wants_an_api_key_is_a_server_not_a_fallback(store, monkeypatch, capsys):
    # Without the key every command says what is wrong: nothing runs in-process, nothing touches the
    # local store (rm/cp/show would otherwise act on it as if no server were there).
    server, host = start_server("tiny-a", kv_size=2048, api_key="s3cret")
    monkeypatch.setenv("TOKENMILL_HOST", f"127.0.0.1:{server.port}")
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    wanted = f"error: the server at http://127.0.0.1:{server.port} requires an API key (set TOKENMILL_API_KEY)\n"
    try:
        assert host.wait_ready(30)
        for argv in (["ps"], ["run", "tiny-a", "hi"], ["run", "tiny-a"], ["show", "tiny-a"], ["stop", "tiny-a"],
                     ["rm", "tiny-b"], ["cp", "tiny-a", "mine"]):
            assert main(argv) == 1, argv
            assert capsys.readouterr().err == wanted, argv
        assert (store / "tiny-b.gguf").exists()
        monkeypatch.setenv("TOKENMILL_API_KEY", "wrong")
        assert main(["ps"]) == 1
        assert "refused the API key in TOKENMILL_API_KEY" in capsys.readouterr().err
        monkeypatch.setenv("TOKENMILL_API_KEY", "s3cret")
        assert main(["run", "tiny-a", "hi", "--max-tokens", "2"]) == 0
        assert "using the server at" in capsys.readouterr().err
        assert main(["ps"]) == 0 and "tiny-a" in capsys.readouterr().out
        assert main(["show", "tiny-a"]) == 0 and "llama" in capsys.readouterr().out
        assert main(["show", "mine"]) == 1 and 'not found' in capsys.readouterr().err  # cp made nothing
    finally:
        server.stop()


def test_interactive_run_checks_the_model_before_the_prompt(store, monkeypatch, capsys):
    server, host = start_server("tiny-a", kv_size=2048)
    monkeypatch.setenv("TOKENMILL_HOST", f"127.0.0.1:{server.port}")
    try:
        assert host.wait_ready(30)
        monkeypatch.setattr("sys.stdin", Terminal("hello\n"))  # never read: the model is unknown
        assert main(["run", "nosuchmodel"]) == 1
        err = capsys.readouterr().err
        assert 'model "nosuchmodel" not found' in err and "Type a message" not in err
        assert "hello" in sys.stdin.read()
        # A known model is loaded first (as Ollama's run does), then the prompt opens.
        monkeypatch.setattr("sys.stdin", Terminal("/bye\n"))
        assert main(["run", "tiny-b"]) == 0
        assert "Type a message" in capsys.readouterr().err
        assert "tiny-b" in {m.name for m in host.loaded_models()}
    finally:
        server.stop()
