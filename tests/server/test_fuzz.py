"""Schemathesis against /openapi.json on a tiny model: valid and invalid requests generated for every
route (but /load and /api/pull, which load and download models) get no 5xx, every error is a JSON
body, and no KV block leaks. TOKENMILL_FUZZ_EXAMPLES sets the examples per route and mode (more for
a longer run)."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.routing import Route

from server_helpers import start_server, wait_idle
from tokenmill.config import Config
from tokenmill.server import ModelHost, create_app
from tokenmill.server.openapi import document

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

# 150 per route and mode: the 2,000+ requests in CI (about 90 s on 2 cores).
EXAMPLES = int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", "150"))
# Generation stays short whatever max_tokens the fuzzer picks: the server-wide cap bounds it.
MAX_TOKENS = 4
REQUESTS: list[str] = []  # one entry per request sent, for the count below
EXCLUDED = {"/load", "/api/pull"}
# Routes that answer 501 by design, with a JSON error: llama-server's /slots (as it does with
# --no-slots) and Ollama's push (no registry here). Any other 5xx is a server error.
NOT_IMPLEMENTED = {"GET /slots", "POST /api/push"}
SERVED_NAME = "tiny-llama"  # the tiny model's file stem

_app = create_app(ModelHost(), Config(), shutdown_host=False)
SCHEMA = schemathesis.openapi.from_dict(document([r for r in _app.routes if isinstance(r, Route)], secured=False))
OPERATIONS = {op.label: op for op in (r.ok() for r in SCHEMA.get_all_operations()) if op.path not in EXCLUDED}


@pytest.fixture(scope="module")
def fuzz_server(tiny_gguf, tmp_path_factory):
    # /api/delete, /api/copy and /api/create write to the model store: never the real one.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_HOME", str(tmp_path_factory.mktemp("fuzz-home")))
        server, host = start_server(str(tiny_gguf), max_tokens=MAX_TOKENS)
        assert host.wait_ready(60), host.error
        yield server, host
        server.stop()


def _served_model(case, name: str) -> None:
    # Mostly the served model: a random name would only ever meet the 404 at the door.
    if isinstance(case.body, dict):
        for key in ("model", "name"):
            if isinstance(case.body.get(key), str) and len(case.body[key]) % 4:
                case.body[key] = name


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_no_server_errors_and_every_error_is_json(label, fuzz_server):
    server, host = fuzz_server
    op = OPERATIONS[label]
    cases = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case):
        _served_model(case, SERVED_NAME)
        response = case.call(base_url=server.url, timeout=60)
        REQUESTS.append(label)
        where = (case.method, case.formatted_path, case.body, response.text[:300])
        assert response.status_code < 500 or (label in NOT_IMPLEMENTED and response.status_code == 501), where
        if response.status_code >= 400:
            body = response.json()
            assert isinstance(body, dict) and body.get("error"), where

    check()
    wait_idle(host, timeout=30)
    # keep_alive 0 may have unloaded it (and a later request loaded it again): check what is loaded.
    for served in host.loaded_models():
        served.aengine.call(lambda e: e.blocks.check_integrity()).result(10)



def test_fuzz_sent_enough_requests():
    """Runs after the fuzz tests of this module (pytest keeps file order)."""
    if len(REQUESTS) < len(OPERATIONS):
        pytest.skip("the fuzz tests did not run (deselected)")
    assert len(REQUESTS) >= 15 * len(OPERATIONS)
    if EXAMPLES >= 150:
        assert len(REQUESTS) >= 2000, len(REQUESTS)
