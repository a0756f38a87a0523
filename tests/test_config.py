"""tokenmill.config: defaults < file < environment < flags, validation errors that name the setting
and its source, and `tokenmill serve --print-config`."""
from __future__ import annotations

import argparse
import dataclasses
import tomllib

import pytest

from tokenmill.cli import build_parser, main
from tokenmill.config import OPTIONS, POLICIES, Config, ConfigError, load_config


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No TOKENMILL_* setting from the caller's environment leaks into these tests."""
    for o in OPTIONS:
        for name in o.env_names:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TOKENMILL_CONFIG", raising=False)


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def write(tmp_path, text: str):
    path = tmp_path / "tokenmill.toml"
    path.write_text(text)
    return path


def test_options_and_config_fields_agree():
    names = [f.name for f in dataclasses.fields(Config) if f.name not in ("sources", "config_file")]
    assert names == [o.name for o in OPTIONS]
    assert all(getattr(Config(), o.name) == o.default for o in OPTIONS)


def test_defaults():
    cfg = load_config(serve_args(), env={})
    assert cfg == Config()
    assert all(cfg.source(o.name) == "default" for o in OPTIONS)
    engine = cfg.engine_config()
    assert engine.max_model_len is None and engine.max_total_tokens == 65536 and engine.enable_prefix_caching


def test_flag_beats_env_beats_file_beats_default(tmp_path):
    path = write(tmp_path, 'port = 1000\nparallel = 3\npolicy = "sjf"\nmax_wait_ms = 5\nnum_ctx = 1024\n')
    env = {"TOKENMILL_PORT": "2000", "TOKENMILL_PARALLEL": "5", "TOKENMILL_CTX": "2048"}
    cfg = load_config(serve_args("--config", str(path), "--port", "3000", "--no-prefix-cache"), env=env)
    assert (cfg.port, cfg.parallel, cfg.policy, cfg.num_ctx, cfg.max_wait_ms) == (3000, 5, "sjf", 2048, 5.0)
    assert cfg.prefix_cache is False and cfg.dtype == "auto"
    assert cfg.source("port") == "flag --port"
    assert cfg.source("parallel") == "env TOKENMILL_PARALLEL"
    assert cfg.source("num_ctx") == "env TOKENMILL_CTX"  # the older name still works
    assert cfg.source("policy") == f"config file {path}"
    assert cfg.source("prefix_cache") == "flag --no-prefix-cache"
    assert cfg.source("dtype") == "default"
    engine = cfg.engine_config()
    assert (engine.policy, engine.max_model_len, engine.parallel, engine.max_wait_ms) == ("sjf", 2048, 5, 5.0)
    assert engine.enable_prefix_caching is False


def test_config_file_from_env_and_flag(tmp_path):
    a = write(tmp_path, "max_queue = 7\n")
    b = tmp_path / "other.toml"
    b.write_text("max_queue = 9\n")
    assert load_config(serve_args(), env={"TOKENMILL_CONFIG": str(a)}).max_queue == 7
    assert load_config(serve_args("--config", str(b)), env={"TOKENMILL_CONFIG": str(a)}).max_queue == 9


def test_host_may_carry_a_port_and_an_explicit_port_wins():
    cfg = load_config(serve_args(), env={"TOKENMILL_HOST": "0.0.0.0:9999"})
    assert (cfg.host, cfg.port) == ("0.0.0.0", 9999) and cfg.source("port") == "env TOKENMILL_HOST"
    cfg = load_config(serve_args("--port", "8000"), env={"TOKENMILL_HOST": "0.0.0.0:9999"})
    assert (cfg.host, cfg.port) == ("0.0.0.0", 8000)
    cfg = load_config(serve_args("--host", "[::1]:5000"), env={"TOKENMILL_PORT": "1"})
    assert (cfg.host, cfg.port) == ("::1", 5000)


def test_env_values_are_parsed_by_type():
    env = {"TOKENMILL_PREFIX_CACHE": "off", "TOKENMILL_AGING_MS": "2.5", "TOKENMILL_BATCH": "64",
           "TOKENMILL_N_UBATCH": "32", "TOKENMILL_HTTP_KEEP_ALIVE": "7", "TOKENMILL_MODEL": "gemma3", "TOKENMILL_DTYPE": ""}
    cfg = load_config(None, env=env)
    assert (cfg.prefix_cache, cfg.aging_ms, cfg.n_batch, cfg.n_ubatch, cfg.http_keep_alive, cfg.model, cfg.dtype) == \
        (False, 2.5, 64, 32, 7.0, "gemma3", "auto")  # an empty variable counts as unset


@pytest.mark.parametrize("text,words", [
    ("paralell = 4\n", ["unknown setting 'paralell'", "did you mean 'parallel'", "tokenmill.toml"]),
    ('port = "80"\n', ["port must be an integer", "'80'", "tokenmill.toml"]),
    ("prefix_cache = 1\n", ["prefix_cache must be true or false", "got 1"]),
    ("parallel = -1\n", ["parallel must be at least 1 (or 0)", "got -1"]),
    ("port = 70000\n", ["port must be at most 65535"]),
    ("num_ctx = 1\n", ["num_ctx must be at least 2 (or 0)"]),
    ('policy = "lifo"\n', ["policy must be one of fifo, priority, sjf", "'lifo'"]),
    ("max_wait_ms = -1\n", ["max_wait_ms must be at least 0"]),
    ("kv_size = 16\nblock_size = 32\n", ["kv_size (16", "below one block"]),
    ("port = \n", ["not valid TOML"]),
    ("[server]\nport = 1\n", ["unknown setting 'server'"]),
])
def test_file_errors_name_the_setting_and_the_file(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(serve_args("--config", str(path)), env={})
    for word in words:
        assert word in str(info.value)


def test_env_and_flag_errors_name_their_source(tmp_path):
    with pytest.raises(ConfigError, match=r"env TOKENMILL_PARALLEL: parallel must be an integer, got 'many'"):
        load_config(None, env={"TOKENMILL_PARALLEL": "many"})
    with pytest.raises(ConfigError, match=r"env TOKENMILL_PREFIX_CACHE: prefix_cache must be true or false"):
        load_config(None, env={"TOKENMILL_PREFIX_CACHE": "maybe"})
    with pytest.raises(ConfigError, match=r"flag --max-wait-ms: max_wait_ms must be a number, got 'soon'"):
        load_config(serve_args("--max-wait-ms", "soon"), env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(serve_args("--config", str(tmp_path / "missing.toml")), env={})


def test_policies_and_block_size_match_the_engine():
    from tokenmill.engine.config import DEFAULT_BLOCK_SIZE, POLICIES as ENGINE_POLICIES, EngineConfig

    assert POLICIES == ENGINE_POLICIES
    assert Config().block_size == DEFAULT_BLOCK_SIZE == EngineConfig().block_size
    assert Config().engine_config().block_size == DEFAULT_BLOCK_SIZE


def test_print_config_shows_values_and_sources(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, 'policy = "priority"\nkv_size = 4096\n')
    monkeypatch.setenv("TOKENMILL_PARALLEL", "8")
    code = main(["serve", "tiny.gguf", "--config", str(path), "--port", "8080", "--max-wait-ms", "2",
                 "--no-prefix-cache", "--print-config"])
    out = capsys.readouterr().out
    assert code == 0
    values = tomllib.loads(out)  # the output is itself a usable config file
    assert set(values) == {o.name for o in OPTIONS}
    assert (values["model"], values["port"], values["parallel"], values["policy"], values["kv_size"]) == \
        ("tiny.gguf", 8080, 8, "priority", 4096)
    assert (values["max_wait_ms"], values["prefix_cache"], values["dtype"]) == (2.0, False, "auto")
    lines = {line.split(" = ")[0]: line for line in out.splitlines() if " = " in line and not line.startswith("#")}
    assert lines["port"].endswith("# flag --port")
    assert lines["parallel"].endswith("# env TOKENMILL_PARALLEL")
    assert lines["policy"].endswith(f"# config file {path}")
    assert lines["model"].endswith("# argument MODEL")
    assert lines["dtype"].endswith("# default")
    # Feeding it back in gives the same configuration.
    again = tmp_path / "again.toml"
    again.write_text(out)
    monkeypatch.delenv("TOKENMILL_PARALLEL")
    assert load_config(serve_args("--config", str(again)), env={}) == \
        load_config(serve_args("tiny.gguf", "--config", str(path), "--port", "8080", "--max-wait-ms", "2",
                               "--no-prefix-cache"), env={"TOKENMILL_PARALLEL": "8"})


def test_print_config_reports_errors(tmp_path, capsys):
    path = write(tmp_path, "bogus = 1\n")
    assert main(["serve", "--config", str(path), "--print-config"]) == 1
    err = capsys.readouterr().err
    assert "unknown setting 'bogus'" in err and str(path) in err


def test_reliability_settings_reach_the_server_and_the_engine():
    env = {"TOKENMILL_API_KEY": "k", "OLLAMA_ORIGINS": "https://x.example", "TOKENMILL_REQUEST_TIMEOUT": "90",
           "TOKENMILL_MAX_TOKENS": "1000", "TOKENMILL_MAX_BODY_BYTES": "4096"}
    cfg = load_config(serve_args("--watchdog-seconds", "3"), env=env)
    assert (cfg.api_key, cfg.origins, cfg.max_body_bytes) == ("k", "https://x.example", 4096)
    engine = cfg.engine_config()
    assert (engine.request_timeout, engine.max_new_tokens, engine.watchdog_seconds) == (90.0, 1000, 3.0)
    assert load_config(None, env={}).engine_config().max_new_tokens is None  # 0: the model's context length
    with pytest.raises(ConfigError, match="TOKENMILL_REQUEST_TIMEOUT"):
        load_config(None, env={"TOKENMILL_REQUEST_TIMEOUT": "-1"})


@pytest.mark.parametrize("data", [b"threads = 1\n# caf\xe9\n", bytes(range(256)) * 4])
def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, capsys, data):
    path = tmp_path / "bad.toml"
    path.write_bytes(data)
    assert main(["serve", "--config", str(path), "--print-config"]) == 1
    assert capsys.readouterr().err == f"error: config file {path} is not valid UTF-8\n"


@pytest.mark.parametrize("value,words", [(":::::", "invalid host in ':::::'"),
                                         ("a b:80", "invalid host in 'a b:80'"),
                                         ("127.0.0.1:80/x", "invalid port in '127.0.0.1:80/x'")])
def test_serve_with_a_bad_host_says_the_host_is_invalid(monkeypatch, capsys, value, words):
    monkeypatch.setenv("TOKENMILL_HOST", value)
    assert main(["serve", "--print-config"]) == 1
    assert capsys.readouterr().err == f"error: env TOKENMILL_HOST: {words}\n"
    monkeypatch.delenv("TOKENMILL_HOST")
    assert main(["serve", "--host", "fe80::1::2", "--print-config"]) == 1
    assert "flag --host: invalid host in 'fe80::1::2'" in capsys.readouterr().err
