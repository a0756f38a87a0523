"""GET /openapi.json: an OpenAPI 3.1 document of every route and the body it accepts.

Body schemas are built from the field sets the handlers themselves check requests against (an
unknown field is logged by warn_unknown), with each field's schema from openapi_fields.py, so the
document cannot drift from what the server takes; tests/server/test_openapi.py checks that every
registered route is described and every accepted field has a schema."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenmill.server import (anthropic_input, ollama, ollama_models, openai_embeddings, openai_params,
                              openai_responses_input, runner_api, runner_info)
from tokenmill.server.errors import is_anthropic_path
from tokenmill.server.ollama_models import tokenmill_version
from tokenmill.server.openapi_fields import FIELDS, INTEGER, OBJECT, OPTIONS, PROMPTS, STRING

NDJSON, SSE, JSON, TEXT = "application/x-ndjson", "text/event-stream", "application/json", "text/plain"
OLLAMA_OPTIONS = {"type": "object", "properties": OPTIONS, "description": "Ollama's model options"}
# llama-server's prompt: text, token ids, both mixed in one list, or a list of such prompts.
_MIXED = {"type": "array", "items": {"oneOf": [{"type": "integer", "minimum": 0}, STRING]}}
RUNNER_PROMPTS = {"oneOf": [STRING, _MIXED, {"type": "array", "items": {"oneOf": [STRING, _MIXED]}}]}
_REFUSED = {"description": "refused (400) unless null: nothing is stored here"}
_REFUSED_NON_EMPTY = {"description": "refused (400) unless null or empty: not supported here"}
# /v1/responses' fields that mean something else there than in the other APIs, or only there.
RESPONSES_OVERRIDES = {
    "input": {"oneOf": [STRING, {"type": "array", "items": OBJECT}],
              "description": "text, or a list of messages, function calls and function call outputs"},
    "instructions": {**STRING, "description": "a system message before the input"},
    "max_output_tokens": {"type": "integer", "minimum": 1},
    "text": {**OBJECT, "description": "format: text, json_object or json_schema"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "include": {"type": "array", "items": STRING},
    "truncation": STRING, "reasoning": OBJECT, "max_tool_calls": INTEGER,
    "prompt": {**OBJECT, **_REFUSED}, "previous_response_id": {**STRING, **_REFUSED}, "conversation": _REFUSED,
    "background": {"type": "boolean", **_REFUSED},
}

# /v1/messages' (Anthropic's) fields that mean something else there.
_TEXT_BLOCKS = {"oneOf": [STRING, {"type": "array", "items": OBJECT}]}
_ANTHROPIC_MESSAGE = {"type": "object", "required": ["role", "content"],
                      "properties": {"role": {"type": "string", "enum": ["user", "assistant"]},
                                     "content": _TEXT_BLOCKS}}
MESSAGES_OVERRIDES = {
    "messages": {"type": "array", "items": _ANTHROPIC_MESSAGE,
                 "description": "user and assistant turns: text, tool_use and tool_result blocks; a final "
                                "assistant message is continued"},
    "system": {**_TEXT_BLOCKS, "description": "the system prompt: text or text blocks"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "stop_sequences": {"type": "array", "items": STRING},
    "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"],
                                         "properties": {"name": STRING, "description": STRING,
                                                        "input_schema": OBJECT}}},
    "tool_choice": {**OBJECT, "description": 'auto, any, none, or {"type": "tool", "name": ...}'},
    "thinking": {**OBJECT, "description": "accepted; no model here has a thinking mode"},
    "output_config": {**OBJECT, "description": 'format: {"type": "json_schema", "schema": ...} (structured output)'},
    "output_format": {**OBJECT, "description": "older spelling of output_config.format"},
    **{k: {**v, "description": "accepted; no effect"} for k, v in {
        "cache_control": OBJECT, "diagnostics": OBJECT, "inference_geo": STRING, "speed": STRING,
        "user_profile_id": STRING, "workspace_id": STRING}.items()},
    "mcp_servers": {"type": "array", "items": OBJECT, **_REFUSED_NON_EMPTY},
    "container": {**STRING, **_REFUSED_NON_EMPTY},
}


@dataclass(frozen=True)
class Operation:
    summary: str
    fields: frozenset[str] | None = None          # the request body's fields; None: no body
    overrides: dict[str, dict] = field(default_factory=dict)  # where a field means something else here
    required: tuple[str, ...] = ()
    stream: str | None = None                     # the media type when the body asks to stream
    response: str = JSON
    raw_body: str | None = None                   # the media type of a body that is not JSON (a blob)


def _op(summary: str, fields=None, **kw) -> Operation:
    return Operation(summary, frozenset(fields) if fields is not None else None, **kw)


OPERATIONS: dict[tuple[str, str], Operation] = {
    # llama-server style runner endpoints
    ("POST", "/load"): _op("Load (or switch to) a model in the background", runner_api.LOAD_FIELDS),
    ("GET", "/health"): _op("Whether a model is loaded and the engine is serving (no API key needed)"),
    ("POST", "/completion"): _op("Complete a prompt (llama-server)", runner_api.COMPLETION_FIELDS,
                                 overrides={"prompt": RUNNER_PROMPTS}, stream=SSE),
    ("POST", "/completions"): _op("Alias of /completion", runner_api.COMPLETION_FIELDS,
                                  overrides={"prompt": RUNNER_PROMPTS}, stream=SSE),
    ("POST", "/embedding"): _op("Embed a text (llama-server)", runner_api.EMBEDDING_FIELDS,
                                overrides={"input": STRING}),
    ("POST", "/tokenize"): _op("Text or chat messages to token ids", runner_api.TOKENIZE_FIELDS),
    ("POST", "/detokenize"): _op("Token ids to text", runner_api.DETOKENIZE_FIELDS, required=("tokens",)),
    ("GET", "/props"): _op("The model's context size, chat template and /completion's defaults (llama-server)"),
    ("GET", "/slots"): _op("Refused (501), as llama-server with --no-slots: there are no slots"),
    ("POST", "/apply-template"): _op("Chat messages to the prompt text (llama-server)",
                                     runner_info.APPLY_TEMPLATE_FIELDS, required=("messages",)),
    # Ollama
    ("GET", "/"): _op("`Ollama is running`", response=TEXT),
    ("GET", "/api/version"): _op("Ollama API version, tokenmill version and kernels"),
    ("GET", "/api/tags"): _op("Installed models"),
    ("POST", "/api/show"): _op("A model's details and metadata", ollama_models.SHOW_FIELDS,
                               overrides={"options": OBJECT}),
    ("GET", "/api/ps"): _op("The loaded models, their size in memory and when they unload"),
    ("DELETE", "/api/delete"): _op("Remove an installed or created model", {"model", "name"}),
    ("POST", "/api/copy"): _op("Give a model another name", {"source", "destination"},
                               required=("source", "destination")),
    ("POST", "/api/create"): _op("Create a model from an installed one (Modelfile-lite)",
                                 ollama_models.CREATE_FIELDS, stream=NDJSON),
    ("POST", "/api/pull"): _op("Download a catalog model", ollama_models.PULL_FIELDS, stream=NDJSON),
    ("POST", "/api/push"): _op("Refused (501): there is no registry to push to", ollama_models.PULL_FIELDS),
    ("POST", "/api/blobs/{digest}"): _op("Push a GGUF file as a blob named by its digest (`sha256:<hex>`); "
                                         "HEAD says whether it is held", raw_body="application/octet-stream"),
    ("POST", "/api/generate"): _op("Generate from a prompt (Ollama)", ollama.GENERATE_FIELDS,
                                   overrides={"options": OLLAMA_OPTIONS}, stream=NDJSON),
    ("POST", "/api/chat"): _op("Chat (Ollama)", ollama.CHAT_FIELDS, overrides={"options": OLLAMA_OPTIONS},
                               stream=NDJSON),
    ("POST", "/api/embed"): _op("Embed texts (Ollama)", ollama.EMBED_FIELDS, overrides={"options": OLLAMA_OPTIONS}),
    ("POST", "/api/embeddings"): _op("Embed a text (Ollama's older endpoint)", ollama.EMBEDDINGS_FIELDS,
                                     overrides={"options": OLLAMA_OPTIONS}),
    # OpenAI
    ("POST", "/v1/chat/completions"): _op("Chat completion (OpenAI)", openai_params.CHAT_FIELDS,
                                          required=("messages",), stream=SSE),
    ("POST", "/v1/completions"): _op("Text completion (OpenAI)", openai_params.COMPLETION_FIELDS,
                                     overrides={"prompt": PROMPTS, "logprobs": INTEGER}, stream=SSE),
    ("POST", "/v1/embeddings"): _op("Embeddings (OpenAI)", openai_embeddings.FIELDS, overrides={"input": PROMPTS},
                                    required=("input",)),
    ("POST", "/v1/responses"): _op("A response (OpenAI's Responses API, stateless: the conversation comes as input)",
                                   openai_responses_input.RESPONSES_FIELDS, overrides=RESPONSES_OVERRIDES,
                                   required=("input",), stream=SSE),
    ("GET", "/v1/models"): _op("Models (OpenAI)"),
    # Anthropic
    ("POST", "/v1/messages"): _op("A message (Anthropic's Messages API)", anthropic_input.MESSAGES_FIELDS,
                                  overrides=MESSAGES_OVERRIDES, required=("messages", "max_tokens"), stream=SSE),
    ("POST", "/v1/messages/count_tokens"): _op("The input tokens of a Messages request",
                                               anthropic_input.COUNT_FIELDS, overrides=MESSAGES_OVERRIDES,
                                               required=("messages",)),
    ("GET", "/v1/models/{model}"): _op("One model (OpenAI)"),
    # operations
    ("GET", "/metrics"): _op("Prometheus metrics", response=TEXT),
    ("GET", "/openapi.json"): _op("This document"),
}

OLLAMA_ERROR = {"type": "object", "required": ["error"], "properties": {"error": STRING}}
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"], "properties": {"type": STRING, "message": STRING}}}}
OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": STRING, "type": STRING, "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}


def openapi_path(starlette_path: str) -> str:
    """`/v1/models/{model:path}` -> `/v1/models/{model}`."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", starlette_path)


def missing_schemas(op: Operation) -> list[str]:
    return sorted(f for f in op.fields or () if f not in op.overrides and f not in FIELDS)


def _body(op: Operation) -> dict:
    props = {name: op.overrides.get(name) or FIELDS[name] for name in sorted(op.fields or ())}
    schema: dict = {"type": "object", "properties": props}
    if op.required:
        schema["required"] = list(op.required)
    return {"required": False, "content": {JSON: {"schema": schema}}}


def _operation(method: str, path: str, op: Operation, secured: bool) -> dict:
    content = {op.response: {"schema": OBJECT if op.response == JSON else STRING}}
    if op.stream:
        content[op.stream] = {"schema": STRING}
    error = ("AnthropicError" if is_anthropic_path(path) else "OpenAIError" if path.startswith("/v1/")
             else "OllamaError")
    out: dict = {
        "summary": op.summary,
        "operationId": f"{method.lower()}_{re.sub(r'[^a-z0-9]+', '_', path.lower()).strip('_') or 'root'}",
        "responses": {"200": {"description": "success", "content": content},
                      "default": {"description": "an error, as JSON",
                                  "content": {JSON: {"schema": {"$ref": f"#/components/schemas/{error}"}}}}},
    }
    params = re.findall(r"\{(\w+)\}", path)
    if params:
        out["parameters"] = [{"name": p, "in": "path", "required": True, "schema": STRING} for p in params]
    if op.fields is not None:
        out["requestBody"] = _body(op)
    if op.raw_body is not None:
        out["requestBody"] = {"required": True, "content": {op.raw_body: {"schema": {"type": "string",
                                                                                        "format": "binary"}}}}
    if secured and path != "/health":
        out["security"] = [{"bearer": []}]
    return out


def document(routes: list[Route], *, secured: bool) -> dict:
    """The document for these routes; a route without an entry in OPERATIONS is a KeyError."""
    paths: dict[str, dict] = {}
    for route in routes:
        path = openapi_path(route.path)
        for method in sorted((route.methods or set()) - {"HEAD"}):
            paths.setdefault(path, {})[method.lower()] = _operation(method, path, OPERATIONS[(method, path)], secured)
    components: dict = {"schemas": {"OllamaError": OLLAMA_ERROR, "OpenAIError": OPENAI_ERROR,
                                    "AnthropicError": ANTHROPIC_ERROR}}
    if secured:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {"openapi": "3.1.0", "info": {"title": "tokenmill", "version": tokenmill_version()},
            "paths": paths, "components": components}


async def openapi_json(request: Request) -> Response:
    app = request.app
    doc = getattr(app.state, "openapi", None)
    if doc is None:
        doc = app.state.openapi = document([r for r in app.routes if isinstance(r, Route)],
                                           secured=bool(app.state.settings.api_key))
    return JSONResponse(doc)


def routes() -> list[Route]:
    return [Route("/openapi.json", openapi_json, methods=["GET"])]
