"""/openapi.json stays true: every registered route is described with its methods, every field a
handler accepts has a schema, and the document is valid OpenAPI 3.1."""
from __future__ import annotations

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from tokenmill.config import Config
from tokenmill.server import ModelHost, create_app
from tokenmill.server.openapi import OPERATIONS, missing_schemas, openapi_path
# The app serves on loopback (Config().host): in-process clients send a loopback Host, not "testserver".
LOCAL = "http://localhost"


@pytest.fixture(scope="module")
def app():
    return create_app(ModelHost(), Config(), shutdown_host=False)


@pytest.fixture(scope="module")
def doc(app):
    with TestClient(base_url=LOCAL, app=app) as c:
        r = c.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def registered(app) -> set[tuple[str, str]]:
    return {(m, openapi_path(r.path)) for r in app.routes if isinstance(r, Route) for m in r.methods if m != "HEAD"}


def test_every_route_is_described_and_nothing_else(app, doc):
    assert registered(app) == set(OPERATIONS)
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert described == registered(app)


def test_every_accepted_field_has_a_schema():
    missing = {key: missing_schemas(op) for key, op in OPERATIONS.items() if missing_schemas(op)}
    assert not missing, f"fields without a schema in server/openapi_fields.py: {missing}"


def test_bodies_list_the_handlers_fields(doc):
    from tokenmill.server import ollama, openai_params

    def props(path):
        return set(doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"])

    assert props("/api/generate") == ollama.GENERATE_FIELDS
    assert props("/v1/chat/completions") == openai_params.CHAT_FIELDS
    options = doc["paths"]["/api/chat"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "num_predict" in options["properties"]["options"]["properties"]


def test_document_is_valid_openapi(doc):
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(doc)


def test_api_key_shows_as_security_and_the_document_needs_it():
    with TestClient(base_url=LOCAL, app=create_app(ModelHost(), Config(api_key="k"), shutdown_host=False)) as c:
        assert c.get("/openapi.json").status_code == 401
        doc = c.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["paths"]["/api/chat"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
