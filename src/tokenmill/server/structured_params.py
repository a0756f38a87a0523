"""The structured-output fields of each API -> a GrammarSpec, compiled into the request's params.

Ollama: `format` ("json" or a JSON Schema). OpenAI: `response_format` (json_object, json_schema)
and vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` or their newer
`structured_outputs` object. llama-server: `grammar` (GBNF) and `json_schema`. At most one per
request; a bad one is a 400 naming the field and what the grammar compiler said."""
from __future__ import annotations

from typing import Any

from tokenmill.engine import SamplingParams
from tokenmill.server.client_json import decode_json
from tokenmill.server.errors import bad_request, shown_value
from tokenmill.structured import GrammarError, GrammarSpec, compiler_for
from tokenmill.tokenizer import Tokenizer

# (spec, the field it came from, for error messages)
Found = tuple[GrammarSpec, str]

GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# vLLM's options beside the constraint: tuning of its backends' JSON (ours already has no free
# whitespace and honours additionalProperties as written), nothing to change in what is allowed.
STRUCTURED_OUTPUTS_OPTIONS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                              "whitespace_pattern"}
OPENAI_FIELDS = {"response_format", "structured_outputs", *GUIDED_FIELDS}
RUNNER_FIELDS = {"grammar", "json_schema"}


def ollama_spec(body: dict) -> Found | None:
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return GrammarSpec("json"), "format"
    if isinstance(fmt, dict):
        return GrammarSpec("json_schema", fmt), "format"
    raise bad_request(f'format must be "json" or a JSON schema object, got {shown_value(fmt)}', "format")


def openai_spec(body: dict) -> Found | None:
    found = [f for f in (_response_format(body.get("response_format")),
                         *(_guided(body, name, kind) for name, kind in GUIDED_FIELDS.items()),
                         _structured_outputs(body.get("structured_outputs"))) if f is not None]
    if len(found) > 1:
        raise bad_request(f"only one structured output constraint may be given, got {' and '.join(f[1] for f in found)}",
                          found[1][1])
    return found[0] if found else None


def runner_spec(body: dict) -> Found | None:
    found = []
    if body.get("json_schema") is not None:
        found.append((GrammarSpec("json_schema", _schema(body["json_schema"], "json_schema")), "json_schema"))
    if body.get("grammar"):  # llama-server sends "" for none
        found.append((GrammarSpec("grammar", body["grammar"]), "grammar"))
    if len(found) > 1:
        raise bad_request("only one of grammar and json_schema may be given", "grammar")
    return found[0] if found else None


async def add_constraint(params: SamplingParams, tokenizer: Tokenizer, found: Found | None) -> None:
    """Compile the constraint off the engine thread and put it in params; a 400 if it is bad."""
    if found is None:
        return
    spec, field = found
    try:
        params.constraint = await compiler_for(tokenizer).compile(spec)
    except GrammarError as exc:
        raise bad_request(f"{field}: {exc}", field) from None


def _response_format(rf: Any) -> Found | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec("json"), "response_format"
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a schema",
                              "response_format.json_schema")
        if spec.get("schema") is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format.json_schema.schema")
        where = "response_format.json_schema.schema"
        return GrammarSpec("json_schema", _schema(spec["schema"], where)), where
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {shown_value(kind)}",
                      "response_format.type")


def _guided(body: dict, name: str, kind: str) -> Found | None:
    value = body.get(name)
    if value is None:
        return None
    return GrammarSpec(kind, _schema(value, name) if kind == "json_schema" else value), name


def _structured_outputs(so: Any) -> Found | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    # An unknown key (a typo, or vLLM's structural_tag) would leave the output unconstrained unnoticed.
    unknown = [k for k in so if k not in STRUCTURED_OUTPUTS_KEYS and k not in STRUCTURED_OUTPUTS_OPTIONS
               and k != "json_object"]
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0][:60]} is not supported; structured_outputs takes one of "
                          f"json, regex, choice, grammar, json_object", f"structured_outputs.{unknown[0][:60]}")
    found = [(GrammarSpec(kind, _schema(so[key], f"structured_outputs.{key}") if kind == "json_schema" else so[key]),
              f"structured_outputs.{key}") for key, kind in STRUCTURED_OUTPUTS_KEYS.items() if so.get(key) is not None]
    if so.get("json_object"):
        found.append((GrammarSpec("json"), "structured_outputs.json_object"))
    if len(found) > 1:
        raise bad_request("structured_outputs takes one of json, regex, choice, grammar, json_object",
                          "structured_outputs")
    return found[0] if found else None


def _schema(value: Any, field: str) -> Any:
    """A schema may come as an object or as its JSON text (vLLM accepts both)."""
    if isinstance(value, str):
        value = decode_json(value, field)
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{field} must be a JSON schema object", field)
    return value
