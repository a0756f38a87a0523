"""/api/create's body, in either of Ollama's forms: a `modelfile` text (older clients) or the fields
newer clients send (`from` or `files`, `system`, `template`, `parameters`, `messages`), turned into
the base (a model name, or the digest of a pushed GGUF blob), its LoRA adapters (pushed blobs too)
and the derived model's profile, checked before anything is stored. A model is made from a name or a
blob, never from a path."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.server.client_json import check_value
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.ollama_params import check_options
from tokenmill.server.profiles import jinja_template
from tokenmill.server.validation import check_name_field, get_dict, get_model_name, get_str
from tokenmill.store.blobs import digest_ref, is_digest, parse_digest
from tokenmill.store.derived import Profile
from tokenmill.store.modelfile import IGNORED_PARAMETER_TYPES, PARAMETER_TYPES, ModelfileError, parse_modelfile
from tokenmill.tokenizer import ChatTemplateError
from tokenmill.tokenizer.chat_template import ChatTemplate

MAX_ADAPTERS = 8  # llama.cpp takes any number; a few is what a merged model needs
CREATE_FIELDS = {"model", "name", "modelfile", "from", "system", "template", "parameters", "messages", "stream",
                 "quantize", "license", "files", "adapters", "path"}
_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class CreateRequest:
    base: str
    profile: Profile
    adapters: tuple[str, ...] = ()  # blob digests, in the order they are merged


def create_request(body: dict) -> CreateRequest:
    if body.get("quantize"):
        raise bad_request("quantize is not supported: tokenmill serves a GGUF's weights as they are; quantize "
                          "the file first (llama.cpp's llama-quantize), then push it", "quantize")
    adapters = _adapters(body)
    text = get_str(body, "modelfile")
    blob = _blob(body)
    if blob is not None and (text or body.get("from")):
        raise bad_request("give either files or from (or a modelfile), not both", "files")
    if text:
        try:
            parsed = parse_modelfile(text)
        except ModelfileError as exc:
            raise bad_request(f"modelfile: {exc}", "modelfile") from None
        # Over HTTP, FROM names a model (or a blob), never a file on the server's disk.
        base, profile = check_name_field(parsed.base, "modelfile", reference=True, what="FROM"), parsed.profile
        # Its quoted values are JSON strings, which may spell a lone surrogate: never stored.
        check_value({"SYSTEM": profile.system, "TEMPLATE": profile.template, "PARAMETER": profile.parameters,
                     "MESSAGE": list(profile.messages)}, "modelfile")
        adapters = _modelfile_adapters(parsed.adapters) + adapters
    else:
        base = blob or get_model_name(body, "from", required=True, reference=True)
        profile = Profile(get_str(body, "system"), get_str(body, "template"), _parameters(body),
                          _messages(body.get("messages")))
    _check_parameters(profile.parameters, modelfile=bool(text))
    if profile.template:
        try:
            ChatTemplate(jinja_template(profile.template))
        except ChatTemplateError as exc:
            raise bad_request(f"template: {exc}", "template") from None
    return CreateRequest(base, profile, adapters)


def _adapters(body: dict) -> tuple[str, ...]:
    """The LoRA adapters' digests `adapters` names ({"name.gguf": "sha256:<hex>"}, as Ollama's clients send
    them after pushing each file), in the order given."""
    value = body.get("adapters")
    if value is None or value == {}:
        return ()
    if not isinstance(value, dict):
        raise bad_request("adapters must be an object: {\"<name>.gguf\": \"sha256:<digest>\"}", "adapters")
    if len(value) > MAX_ADAPTERS:
        raise bad_request(f"adapters: at most {MAX_ADAPTERS} adapters; got {len(value)}", "adapters")
    if not all(is_digest(d) for d in value.values()):
        raise bad_request("adapters: each value is the blob's digest, sha256:<64 hex digits>", "adapters")
    return tuple(digest_ref(parse_digest(d)) for d in value.values())


def _modelfile_adapters(adapters: tuple[str, ...]) -> tuple[str, ...]:
    # Over HTTP, ADAPTER names a pushed blob (the CLI pushes a file it names first), never a server file.
    if len(adapters) > MAX_ADAPTERS:
        raise bad_request(f"modelfile: at most {MAX_ADAPTERS} ADAPTER lines; got {len(adapters)}", "modelfile")
    if not all(is_digest(a) for a in adapters):
        raise bad_request("modelfile: ADAPTER names a pushed blob (sha256:<64 hex digits>), not a file on the "
                          "server", "modelfile")
    return tuple(digest_ref(parse_digest(a)) for a in adapters)


def _check_parameters(parameters: dict, *, modelfile: bool) -> None:
    """The model's PARAMETERs are options every request naming it will carry: checked now by the
    request options' own validator, so a bad one is this 400, not one on every later request."""
    if not modelfile:
        check_options(parameters, "/api/create", "parameters.")
        return
    try:
        check_options(parameters, "/api/create", "PARAMETER ")
    except APIError as exc:
        raise bad_request(f"modelfile: {exc.message}", "modelfile") from None


def _blob(body: dict) -> str | None:
    """The digest of the one GGUF blob `files` names ({"name.gguf": "sha256:<hex>"}, as Ollama's
    clients send it after pushing the file), or None without `files`."""
    files = body.get("files")
    if files is None or files == {}:
        return None
    if not isinstance(files, dict):
        raise bad_request("files must be an object: {\"<name>.gguf\": \"sha256:<digest>\"}", "files")
    if len(files) != 1:
        raise bad_request(f"files: a model is made from one GGUF file; got {len(files)} files", "files")
    [digest] = files.values()  # the file's name says nothing the blob's validation does not check
    if not is_digest(digest):
        raise bad_request("files: the value is the blob's digest, sha256:<64 hex digits>", "files")
    return digest_ref(parse_digest(digest))


def _parameters(body: dict) -> dict:
    params = get_dict(body, "parameters") or {}
    out = {}
    for name, value in params.items():
        ignored = IGNORED_PARAMETER_TYPES.get(name)
        if ignored is not None:  # Ollama's, meaning nothing here: checked, then dropped
            if not _has_type(value, ignored):
                what = {bool: "true or false", int: "an integer", float: "a number"}[ignored]
                raise bad_request(f"parameters.{name} must be {what}", f"parameters.{name}")
            continue
        kind = PARAMETER_TYPES.get(name)
        if kind is None:
            raise bad_request(f"parameters: unknown parameter {name!r}", f"parameters.{name}")
        if name == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise bad_request("parameters.stop must be a string or a list of strings", "parameters.stop")
            out[name] = stops
        elif (isinstance(value, bool) or not isinstance(value, (int, float))
              or (kind is int and isinstance(value, float) and not value.is_integer())):
            raise bad_request(f"parameters.{name} must be {'an integer' if kind is int else 'a number'}",
                              f"parameters.{name}")
        else:
            try:
                out[name] = kind(value)
            except OverflowError:  # an integer too large for a float
                raise bad_request(f"parameters.{name} is out of range", f"parameters.{name}") from None
    return out


def _has_type(value, kind: type) -> bool:
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    return isinstance(value, int) if kind is int else isinstance(value, (int, float))


def _messages(value) -> tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request("messages must be a list", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise bad_request(f"messages[{i}] must have a role ({', '.join(_ROLES)}) and a string content",
                              f"messages[{i}]")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)
