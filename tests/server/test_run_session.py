"""`tokenmill run`'s interactive chat with Ollama's commands, typed into `main(["run", MODEL])`: what
/set changes reaches the model (the server's request, or the in-process engine), /show, /save and
/load act on the store or the server, \"\"\" reads several lines, and a bad value or a failed answer
is an error line after which the session goes on."""
from __future__ import annotations

import json
import os

import httpx
import pytest

import tokenmill.run_chats as run_chats
from server_helpers import Terminal, start_server
from tokenmill.cli import main
from tokenmill.run_session import read_message


def _lines(*lines: str):
    """input() over these lines: EOFError after the last, as at the end of typed input."""
    it = iter(lines)

    def ask(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return ask


@pytest.mark.parametrize("typed, message", [
    (["hello"], "hello"),
    (['"""one line"""'], "one line"),
    (['"""', "two", "lines", '"""'], "two\nlines"),
    (['"""first', "second", 'third"""'], "first\nsecond\nthird"),
    (['  """', "indented start", '"""'], "indented start"),
])
def test_read_message_takes_triple_quoted_lines_as_one(typed, message):
    assert read_message(_lines(*typed)) == message


def test_read_message_ends_with_the_input():
    with pytest.raises(EOFError):
        read_message(_lines())
    with pytest.raises(EOFError):  # inside an unclosed """
        read_message(_lines('"""', "half a message"))


@pytest.fixture
def sent(monkeypatch):
    """The bodies `run` sends to the server's /api/chat, the server answering as usual."""
    bodies: list[dict] = []
    real = run_chats.stream

    def spy(base, path, body):
        bodies.append(json.loads(json.dumps(body)))
        yield from real(base, path, body)

    monkeypatch.setattr(run_chats, "stream", spy)
    return bodies


def test_a_session_on_a_server(store, monkeypatch, capsys, sent):
    server, host = start_server("tiny-a", kv_size=2048)
    monkeypatch.setenv("TOKENMILL_HOST", f"127.0.0.1:{server.port}")
    try:
        assert host.wait_ready(30)
        monkeypatch.setattr("sys.stdin", Terminal("\n".join([
            "/set system Answer in French.", "/set parameter temperature 0", "/set parameter num_predict 3",
            "/set parameter stop END \"FIN\"", "/set parameter num_gpu 99", "/set verbose",
            "hello", '"""', "two", "lines", '"""',
            "/show system", "/show parameters", "/set parameter temperature warm", "/nonsense", "/save french",
            "/clear", "again", "/bye"]) + "\n"))
        assert main(["run", "tiny-a"]) == 0
        out, err = capsys.readouterr()
        first, second, third = sent
        assert first["messages"] == [{"role": "system", "content": "Answer in French."},
                                     {"role": "user", "content": "hello"}]
        assert first["options"] == {"temperature": 0.0, "num_predict": 3, "stop": ["END", "FIN"]}
        assert second["messages"][1]["content"] == "hello" and second["messages"][2]["role"] == "assistant"
        assert second["messages"][-1] == {"role": "user", "content": "two\nlines"}
        # /clear forgot the conversation, not the system message
        assert third["messages"] == [{"role": "system", "content": "Answer in French."},
                                     {"role": "user", "content": "again"}]
        assert err.count("\neval count:") == 3 and "prompt eval rate:" in err  # /set verbose
        assert "Answer in French." in out and "temperature" in out and "END FIN" in out
        assert "PARAMETER temperature must be a number, got 'warm'" in err
        assert "Unknown command '/nonsense'" in err and "Created new model 'french'" in err
        assert "Parameter 'num_gpu' means nothing here" in err
        # /save made a model of the session, on the server
        with httpx.Client(base_url=server.url, timeout=30) as c:
            shown = c.post("/api/show", json={"model": "french"}).json()
        assert shown["system"] == "Answer in French." and "temperature" in shown["parameters"]
        assert 'MESSAGE user """hello"""' in shown["modelfile"]
    finally:
        server.stop()


def test_a_session_in_process(store, nobody_listens, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", Terminal("\n".join([
        "/set parameter num_predict 4", "/set format json", "/set verbose", "hi",
        "/set parameter num_ctx 64", "hello", "/set noformat", "/show info", "/load tiny-b", "/show system",
        "/set parameter seed 7", "/save seeded", "hey", "/set quiet", "/set parameter num_predict -1", "yo",
        "/set parameter top_p 7", "yo again", "/bye"]) + "\n"))
    assert main(["run", "tiny-a", "--dtype", "fp32"]) == 0
    out, err = capsys.readouterr()
    assert out.count('>>> {"') == 2  # /set format json: both answers begin a JSON object, until /set noformat
    assert err.count("\neval count:") == 3  # hi, hello, hey; then /set quiet
    assert err.count("error:") == 2 and "error: top_p must be between 0 and 1, got 7" in err  # "yo" answered
    assert "eval count:           4 token(s)" in err  # num_predict reached the engine
    assert "error: /set parameter num_ctx: only a server uses it" in err
    assert "llama" in out and "No system was specified for this model." in out
    assert "Loading model 'tiny-b'" in err and "running tiny-b in-process" in err
    assert main(["show", "seeded"]) == 0  # /save made it on the store, from tiny-b
    assert "seed" in capsys.readouterr().out


def test_one_answer_in_json_with_its_figures(store, nobody_listens, capsys):
    assert main(["run", "tiny-a", "hi", "--format", "json", "--verbose", "--max-tokens", "5", "--dtype", "fp32"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith('{"') and "\neval count:           5 token(s)" in err


def _read_until(fd: int, wanted: bytes, seconds: float = 60) -> bytes:
    import select
    import time

    seen, deadline = b"", time.monotonic() + seconds
    while wanted not in seen:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"no {wanted!r} within {seconds} s; got {seen[-300:]!r}")
        seen += os.read(fd, 4096)
    return seen


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_chat_on_a_terminal_keeps_its_history(store, nobody_listens):
    # Line editing and a history across chats, as Ollama's: on a real terminal only.
    import subprocess
    import sys

    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "run", "tiny-a", "--dtype", "fp32"],
                            stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    try:
        _read_until(master, b">>> ")
        os.write(master, b"/set verbose\r")
        _read_until(master, b"Set 'verbose' mode.")
        os.write(master, b"/bye\r")
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        os.close(master)
    history = (store.parent / "history").read_text()
    assert "/set verbose" in history and "/bye" in history
