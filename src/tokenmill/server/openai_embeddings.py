"""/v1/embeddings. The official Python client asks for base64 unless told otherwise (it decodes
little-endian float32), so both encodings are served."""
from __future__ import annotations

import base64
import math

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.server.chat import chars_in, check_token_ids, encode_prompt, off_loop
from tokenmill.server.embedding import embed, embedding_limit, fit_to_context, requested_dimensions
from tokenmill.server.model_host import model_for
from tokenmill.server.errors import bad_request, shown_value
from tokenmill.server.openai_params import get_truncate, truncate_prompt
from tokenmill.server.validation import get_model_name, get_str, read_json, warn_unknown

FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"}


def _inputs(value, tok) -> list[list[int]]:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and value:
        if all(isinstance(s, str) for s in value):
            if any(not s for s in value):
                raise bad_request("input must not contain empty strings", "input")
            return [encode_prompt(tok, s) for s in value]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [check_token_ids(value, tok.vocab_size, "input")]
        if all(isinstance(p, list) and p for p in value):
            return [check_token_ids(p, tok.vocab_size, "input") for p in value]
    raise bad_request("input must be a non-empty string, list of strings, list of token ids or list of such lists",
                      "input")


def _encode(vec: list[float], fmt: str, dims: int | None):
    if dims is not None and dims < len(vec):
        head = vec[:dims]
        norm = math.sqrt(sum(x * x for x in head)) or 1.0
        vec = [x / norm for x in head]
    if fmt == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec


async def embeddings(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, FIELDS, "/v1/embeddings")
    host = request.app.state.host
    served = await model_for(request, get_model_name(body))
    fmt = get_str(body, "encoding_format", "float")
    get_str(body, "user")  # unused here, but a string as OpenAI and vLLM require (400 otherwise)
    if fmt not in ("float", "base64"):
        raise bad_request(f"encoding_format must be float or base64, got {shown_value(fmt)}", "encoding_format")
    dims = requested_dimensions(body, served)
    truncate = get_truncate(body)  # 0 was taken as "no truncation"; a 400 as in the completions routes
    limit = embedding_limit(served)
    inputs = await off_loop(lambda: _inputs(body.get("input"), served.engine.tokenizer), chars_in(body.get("input")))
    id_lists = [fit_to_context(truncate_prompt(ids, truncate, limit + 1), limit, False, "input") for ids in inputs]
    slot = host.admission.enter()
    try:
        vectors = [await embed(served, ids) for ids in id_lists]
    finally:
        slot.release()
    num_tokens = sum(len(ids) for ids in id_lists)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, fmt, dims)} for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": served.name,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
