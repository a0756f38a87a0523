"""llama-server's endpoints around /completion that clients read before they complete anything:
GET /props (the context size, the chat template and the sampling defaults), GET /slots (refused
as llama-server refuses it with --no-slots: the engine schedules sequences, it has no slots), and
POST /apply-template (chat messages to the prompt text /completion would take)."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenmill.server import profiles
from tokenmill.server.chat import chars_in, normalize_messages, off_loop
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.model_host import model_for
from tokenmill.server.ollama_models import tokenmill_version
from tokenmill.server.runner_api import sampling_defaults
from tokenmill.server.validation import check_name_field, get_model_name, read_json, warn_unknown
from tokenmill.tokenizer import ChatTemplateError, TokenizerError

APPLY_TEMPLATE_FIELDS = {"messages", "model"}


async def props(request: Request) -> Response:
    name = request.query_params.get("model") or None  # llama-server's router mode names the model so
    if name:
        check_name_field(name, "model")
    served = await model_for(request, name)
    engine = served.engine
    # A model made with a TEMPLATE is served with it (profiles.tokenizer_for), so that is the one to show.
    chat = profiles.tokenizer_for(engine.tokenizer, served.profile).chat_template
    template = chat.source if chat is not None else ""
    return JSONResponse({
        "default_generation_settings": {"n_ctx": engine.max_model_len,
                                        "params": sampling_defaults(engine.tokenizer)},
        "total_slots": engine.cfg.parallel,
        # The model's name, never where its file is (llama-server gives the path it was started with).
        "model_alias": served.name,
        "model_path": served.name,
        "chat_template": template,
        "modalities": {"vision": False, "audio": False},
        "build_info": f"tokenmill {tokenmill_version()}",
    })


async def slots(request: Request) -> Response:
    raise APIError(501, "This server does not support slots endpoint: sequences are scheduled by the engine, "
                        "not held in slots")


async def apply_template(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, APPLY_TEMPLATE_FIELDS, "/apply-template")
    if body.get("messages") is None:
        raise bad_request("messages is required", "messages")
    messages = normalize_messages(body["messages"])
    served = await model_for(request, get_model_name(body))
    # The prompt the chat endpoints would render: a created model's TEMPLATE, SYSTEM and MESSAGEs too.
    tok = profiles.tokenizer_for(served.engine.tokenizer, served.profile)
    messages = profiles.chat_messages(messages, served.profile)
    try:
        text = await off_loop(lambda: tok.apply_chat_template(messages, add_generation_prompt=True),
                              chars_in(messages))
    except ChatTemplateError as exc:
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None
    except TokenizerError as exc:  # no chat template
        raise bad_request(str(exc), "messages") from None
    return JSONResponse({"prompt": text})


def routes() -> list[Route]:
    return [
        Route("/props", props, methods=["GET"]),
        Route("/slots", slots, methods=["GET"]),
        Route("/apply-template", apply_template, methods=["POST"]),
    ]
