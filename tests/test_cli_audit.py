"""The command line as an Ollama user meets it, end to end through `main([...])`: every failure is one
line on stderr naming what was wrong, with a non-zero exit code, never a traceback. A scripted HTTP
server stands in for servers that misbehave (cut answers, HTML error pages, huge bodies) that a real
tokenmill server does not produce on purpose."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.cli import main


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """TOKENMILL_HOME with one tiny model, tiny-a, and no server where TOKENMILL_HOST points."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TOKENMILL_HOST", "127.0.0.1:9")  # the discard port: nothing answers
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    write_tiny_llama(models / "tiny-a.gguf", TinyLlamaSpec(seed=1))
    return models


def one_error_line(err: str) -> str:
    """The error line of a command's stderr; fails on a traceback or a second error line."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


# --- a scripted server ----------------------------------------------------------------------------
class Scripted:
    """Answers /api/version like an Ollama server; every other route answers `reply` (status, body,
    declared length: more than the body sent = a connection cut mid-answer). Requests are kept."""

    def __init__(self):
        self.reply: tuple[int, bytes, int | None] = (200, b"{}", None)
        self.requests: list[tuple[str, str, bytes]] = []
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: bytes, length: int | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(length or len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                self.close_connection = True

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/api/version":
                    return self._answer(200, b'{"version": "0.0.0"}')
                scripted.requests.append((self.command, self.path, body))
                self._answer(*scripted.reply)

            do_GET = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted(monkeypatch):
    server = Scripted()
    monkeypatch.setenv("TOKENMILL_HOST", server.address)
    yield server
    server.close()


def ndjson(*objs: dict) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


SERVER_COMMANDS = [["ps"], ["show", "m"], ["rm", "m"], ["stop", "m"], ["cp", "m", "n"], ["run", "m", "hi"],
                   ["run", "m", "hi", "--raw"]]


@pytest.mark.parametrize("argv", SERVER_COMMANDS)
def test_an_answer_cut_short_is_an_error_not_a_traceback(scripted, argv, capsys):
    # A server that dies mid-answer: the body is shorter than its Content-Length. `call` let
    # http.client's IncompleteRead out (a traceback); `run` printed the part it had and exited 0.
    scripted.reply = (200, ndjson({"message": {"content": "part"}, "response": "part", "done": False}), 100000)
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert one_error_line(err) == (f"error: the server at http://{scripted.address} closed the connection "
                                   "before its answer was complete")
    assert out in ("", "part\n")  # what came is shown, on a line of its own


@pytest.mark.parametrize("argv", SERVER_COMMANDS)
def test_an_answer_that_is_not_json_is_one_line(scripted, argv, capsys):
    # A proxy's HTML page with status 200 was a JSONDecodeError traceback (ps, show, rm, stop, cp),
    # or `error: Expecting value: line 1 column 1 (char 0)` (run).
    scripted.reply = (200, b"<html><body>Bad gateway</body></html>\n", None)
    assert main(argv) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: http://{scripted.address} answered something that is not JSON: <html>")


@pytest.mark.parametrize("argv", SERVER_COMMANDS)
def test_a_huge_error_body_is_cut_to_one_readable_line(scripted, argv, capsys):
    scripted.reply = (500, json.dumps({"error": "boom\n" + "x" * 100_000}).encode(), None)
    assert main(argv) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: server answered 500: boom xxx") and line.endswith("...") and len(line) < 400


def test_an_error_in_the_middle_of_an_answer_gets_its_own_line(scripted, capsys):
    scripted.reply = (200, ndjson({"message": {"content": "Once upon"}, "done": False}, {"error": "engine failed"}),
                      None)
    assert main(["run", "m", "tell a story"]) == 1
    out, err = capsys.readouterr()
    assert out == "Once upon\n"  # was "Once upon" with "error: ..." glued after it on the terminal
    assert one_error_line(err) == "error: engine failed"


# --- run: the prompt from a pipe -----------------------------------------------------------------
def test_piped_stdin_is_the_prompt_as_in_ollama(scripted, monkeypatch, capsys):
    # `cat notes | tokenmill run m "summarize"`: one answer to stdin then the argument, as `ollama run`
    # does. It used to open the chat: each piped line a turn, with ">>> " prompts in the output.
    scripted.reply = (200, ndjson({"message": {"content": "short"}, "done": False},
                                  {"message": {"content": ""}, "done": True}), None)
    monkeypatch.setattr("sys.stdin", io.StringIO("line one\nline two\n"))
    assert main(["run", "m", "summarize"]) == 0
    out, err = capsys.readouterr()
    assert out == "short\n" and ">>>" not in out and "Type a message" not in err
    [(method, path, body)] = scripted.requests
    assert (method, path) == ("POST", "/api/chat")
    assert json.loads(body)["messages"] == [{"role": "user", "content": "line one\nline two\n summarize"}]


def test_piped_stdin_without_a_prompt_argument_is_the_whole_prompt(scripted, monkeypatch, capsys):
    scripted.reply = (200, ndjson({"response": "ok", "done": True}), None)
    monkeypatch.setattr("sys.stdin", io.StringIO("2+2="))
    assert main(["run", "m", "--raw"]) == 0
    assert capsys.readouterr().out == "ok\n"
    [(_, path, body)] = scripted.requests
    assert path == "/api/generate" and json.loads(body)["prompt"] == "2+2="


@pytest.mark.parametrize("stdin", [io.StringIO(""), None])
def test_run_with_empty_or_closed_stdin_loads_the_model_and_exits(scripted, monkeypatch, stdin, capsys):
    # `tokenmill run m < /dev/null` (or with stdin closed): nothing to say, so no chat opens (input()
    # on a closed stdin was "error: input(): lost sys.stdin"); the model is loaded and checked.
    scripted.reply = (200, b'{"done": true}', None)
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["run", "m"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "Type a message" not in err
    [(_, path, body)] = scripted.requests
    assert path == "/api/generate" and json.loads(body) == {"model": "m", "stream": False}


def test_run_with_empty_stdin_and_an_unknown_model_says_so(scripted, monkeypatch, capsys):
    scripted.reply = (404, b'{"error": "model \\"nope\\" not found, try pulling it first"}', None)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["run", "nope"]) == 1
    assert one_error_line(capsys.readouterr().err) == \
        'error: server answered 404: model "nope" not found, try pulling it first'


# --- list -----------------------------------------------------------------------------------------
def test_ls_is_list(home, capsys):
    assert main(["ls"]) == 0  # Ollama's spelling was "invalid choice: 'ls'"
    out = capsys.readouterr().out
    assert out.startswith("NAME") and "tiny-a" in out


# --- serve's settings -----------------------------------------------------------------------------
@pytest.mark.parametrize("flags,env,wanted", [
    (["--drain-timeout", "nan"], {}, "error: flag --drain-timeout: drain_timeout must be a finite number, got nan"),
    (["--max-memory-gb", "inf"], {}, "error: flag --max-memory-gb: max_memory_gb must be a finite number, got inf"),
    ([], {"TOKENMILL_REQUEST_TIMEOUT": "-inf"},
     "error: env TOKENMILL_REQUEST_TIMEOUT: request_timeout must be a finite number, got -inf"),
    (["--threads", "99999999999999"], {}, "error: flag --threads: threads must be at most 1024, got 99999999999999"),
])
def test_settings_that_crashed_at_startup_are_refused_first(home, monkeypatch, capsys, flags, env, wanted):
    # nan passed every bound and inf every check; both then crashed startup (int(nan): ValueError,
    # int(inf): OverflowError, a thread count beyond a C int: TypeError), each as a traceback.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "tiny-a", *flags, "--print-config"]) == 1
    assert capsys.readouterr().err == wanted + "\n"


def test_a_config_file_with_nan_names_the_file(home, tmp_path, capsys):
    config = tmp_path / "tokenmill.toml"
    config.write_text("http_keep_alive = nan\n")
    assert main(["serve", "--config", str(config), "--print-config"]) == 1
    assert capsys.readouterr().err == \
        f"error: config file {config}: http_keep_alive must be a finite number, got nan\n"


def test_serving_a_file_that_is_not_gguf_is_refused_before_listening(home, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    assert main(["serve", str(notes), "--port", "0"]) == 1  # it used to serve, its one model never loading
    assert capsys.readouterr().err == f"error: {notes} is not a GGUF file\n"


def test_device_cuda_without_cuda_is_refused_before_listening(home, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["serve", "tiny-a", "--device", "cuda", "--port", "0"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: flag --device: device cuda asked for, but ")


@pytest.mark.parametrize("draft,wanted", [
    ("nonexistent", "draft model 'nonexistent': unknown model 'nonexistent'"),
    ("{notes}", "draft model '{notes}': {notes} is not a GGUF file"),
])
def test_a_draft_model_that_cannot_load_is_refused_before_listening(home, tmp_path, capsys, draft, wanted):
    # The draft loads with every model and is never pulled: the server used to start and then fail
    # every model's load, the reason only in its log.
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    assert main(["serve", "tiny-a", "--port", "0", "--speculative", "draft:" + draft.format(notes=notes)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: flag --speculative: " + wanted.format(notes=notes))


@contextlib.contextmanager
def _serving(*flags: str):
    """`tokenmill serve tiny-a --port 0 ...` in a process of its own: the URL its 'listening on' line names."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "tiny-a", "--port", "0",
                             "--no-compile", "--log-level", "warning", *flags],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if "listening on" in line:
                break
        else:
            pytest.fail("serve printed no 'listening on' line")
        yield line.split("listening on ")[1].split(",")[0]
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_on_port_0_says_which_port_it_got(home, tmp_path):
    # "listening on http://127.0.0.1:0" named a port no client can reach; the chosen one is shown.
    import urllib.request

    with _serving() as url:
        assert not url.endswith(":0")
        with urllib.request.urlopen(url + "/api/version", timeout=30) as resp:
            assert "version" in json.loads(resp.read())


@pytest.mark.parametrize("value, url", [("", "http://127.0.0.1:11434"), ("example.org", "http://example.org:11434"),
                                        ("http://0.0.0.0:8080", "http://127.0.0.1:8080"),
                                        ("https://example.org", "https://example.org:443"),
                                        ("HTTPS://[::1]:8443/", "https://[::1]:8443")])
def test_the_client_keeps_the_scheme_it_is_given(monkeypatch, value, url):
    from tokenmill.server_client import server_url

    monkeypatch.setenv("TOKENMILL_HOST", value)
    assert server_url() == url


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_serve_over_https_with_a_certificate(home, tmp_path, capsys):
    import ssl
    import urllib.request

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    # Half a pair, or a key that is no key, is refused before listening.
    assert main(["serve", "tiny-a", "--ssl-certfile", str(cert)]) == 1
    assert "ssl_certfile is set (flag --ssl-certfile) but ssl_keyfile is not" in capsys.readouterr().err
    assert main(["serve", "tiny-a", "--ssl-certfile", str(cert), "--ssl-keyfile", str(cert)]) == 1
    assert "cannot use" in capsys.readouterr().err
    with _serving("--ssl-certfile", str(cert), "--ssl-keyfile", str(key)) as url:
        assert url.startswith("https://")
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(url + "/api/version", timeout=30, context=context) as resp:
            assert "version" in json.loads(resp.read())
        # The CLI's client reaches it at TOKENMILL_HOST=https://..., trusting the certificate as OpenSSL is told.
        env = {**os.environ, "TOKENMILL_HOST": url, "SSL_CERT_FILE": str(cert)}
        run = subprocess.run([sys.executable, "-m", "tokenmill.cli", "run", "tiny-a", "hi", "--max-tokens", "2"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and f"using the server at {url}" in run.stderr, run.stderr


# --- create ---------------------------------------------------------------------------------------
def test_create_reports_a_bad_parameter_value_by_line(home, tmp_path, capsys):
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM tiny-a\n# a comment\nSYSTEM \"\"\"be\nbrief\"\"\"\nPARAMETER num_ctx -5\n")
    assert main(["create", "mine", "-f", str(modelfile)]) == 1
    assert capsys.readouterr().err == "error: line 5: PARAMETER num_ctx must be at least 2, got -5\n"


@pytest.mark.parametrize("content,wanted", [
    (None, "error: no Modelfile at {path} (name one with -f)"),
    (b"FROM tiny-a\n\xff\xfe\n", "error: {path} is not a text Modelfile: not UTF-8 at byte 12"),
])
def test_create_with_an_unreadable_modelfile_is_one_line(home, tmp_path, capsys, content, wanted):
    path = tmp_path / "Modelfile"
    if content is not None:
        path.write_bytes(content)
    assert main(["create", "mine", "-f", str(path)]) == 1
    assert capsys.readouterr().err == wanted.format(path=path) + "\n"


def test_create_from_a_file_that_is_not_gguf_sends_nothing(scripted, tmp_path, capsys):
    # It was pushed to the server as a blob first ("transferring model data"), then refused there.
    (tmp_path / "notes.txt").write_text("not a model\n")
    (tmp_path / "Modelfile").write_text("FROM ./notes.txt\n")
    assert main(["create", "mine", "-f", str(tmp_path / "Modelfile")]) == 1
    assert capsys.readouterr().err == "error: FROM ./notes.txt: not a GGUF file\n"
    assert scripted.requests == []


# --- bench ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bench", ["offline", "single-stream"])
def test_a_benchmark_of_an_unknown_model_is_one_line(home, bench, capsys):
    assert main(["bench", bench, "--model", "nope"]) == 1  # was an UnknownModelError traceback
    assert one_error_line(capsys.readouterr().err.replace(f"tokenmill bench {bench}: error:", "error:")) \
        .startswith("error: unknown model 'nope'")


def test_a_benchmark_of_a_file_that_is_not_gguf_is_one_line(home, tmp_path, capsys):
    notes = tmp_path / "notes.gguf"
    notes.write_text("not a model\n")
    assert main(["bench", "single-stream", "--model", str(notes)]) == 1  # was a GGUFError traceback
    err = capsys.readouterr().err
    assert "Traceback" not in err and "tokenmill bench single-stream: error: " in err and "not a GGUF file" in err


def test_an_unknown_benchmark_goes_to_stderr(capsys):
    assert main(["bench", "nope"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("tokenmill bench: unknown benchmark 'nope'")
