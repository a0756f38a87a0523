"""GET /v1/models and /v1/models/{id} as Anthropic's SDK reads them (`client.models.list()`,
`.retrieve()`): asked with its `anthropic-version` header, the installed models come as its model
objects (type, id, display_name, created_at) in one page, rather than as OpenAI's list."""
from __future__ import annotations

from starlette.requests import Request

from tokenmill.server import model_info

VERSION_HEADER = "anthropic-version"


def wants_anthropic(request: Request) -> bool:
    return VERSION_HEADER in request.headers


def model_card(e: model_info.ModelEntry, max_input_tokens: int | None) -> dict:
    card = {"type": "model", "id": e.name, "display_name": e.name, "created_at": model_info.iso_time(e.modified_at),
            "lifecycle": "active"}
    if max_input_tokens is not None:
        card["max_input_tokens"] = max_input_tokens
    return card


def model_list(cards: list[dict]) -> dict:
    """Every model in one page (has_more false: the SDK's pager stops there)."""
    return {"data": cards, "has_more": False, "first_id": cards[0]["id"] if cards else None,
            "last_id": cards[-1]["id"] if cards else None}
