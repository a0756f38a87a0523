"""From an HTTP request to its RoutingKey: the prompt rendered and tokenized as the replica will
(same chat template, same tokenizer, loaded from the GGUF without its weights), then keyed in
blocks. Routing is a hint: a request the key maker cannot read gets an empty key (least-loaded
routing) and the replica answers it with the proper error."""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from tokenmill.ray.prefix_summary import RoutingKey, request_keys
from tokenmill.server.anthropic_input import chat_body as messages_chat_body
from tokenmill.server.chat import encode_prompt, normalize_messages, render_chat, render_prompt
from tokenmill.server.openai_responses_input import chat_body as responses_chat_body
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.ray")

SESSION_HEADER = "x-session-id"
# Enough blocks to tell long shared prefixes (system prompts, documents, conversations) apart;
# beyond this the request's own tail decides nothing about where its prefix lives.
MAX_KEY_BLOCKS = 256


class RoutingKeyMaker:
    def __init__(self, tokenizer: Tokenizer, block_size: int, max_blocks: int = MAX_KEY_BLOCKS):
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_blocks = max_blocks

    def prompt_ids(self, path: str, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt a generation route will run, or None for routes that have none."""
        tok = self.tokenizer
        # The Responses and Messages APIs run as the chat body they translate into (server/*_input.py).
        if path == "/v1/responses":
            path, body = "/v1/chat/completions", responses_chat_body(dict(body))
        elif path == "/v1/messages":
            path, body = "/v1/chat/completions", messages_chat_body(dict(body))[0]
        if path in ("/v1/chat/completions", "/api/chat"):
            messages = normalize_messages(body.get("messages") or [])
            return render_chat(tok, messages, tools=body.get("tools") or None) if messages else None
        if path == "/api/generate":
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                return None
            context = body.get("context") if isinstance(body.get("context"), list) else []
            system = body.get("system") if isinstance(body.get("system"), str) else None
            return list(context) + render_prompt(tok, prompt, system=system, raw=bool(body.get("raw")))
        if path in ("/v1/completions", "/completion", "/completions"):
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]  # a batch of prompts: the first one places it
            if isinstance(prompt, str):
                return encode_prompt(tok, prompt)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
        return None

    def key(self, path: str, body: bytes, headers: Mapping[str, str]) -> RoutingKey:
        session = headers.get(SESSION_HEADER) or None
        try:
            parsed = json.loads(body) if body else None
            ids = self.prompt_ids(path, parsed) if isinstance(parsed, dict) else None
        except Exception as exc:  # noqa: BLE001 - an unreadable request routes by load; the replica rejects it
            log.debug("no routing key for %s: %s", path, exc)
            ids = None
        blocks = request_keys(ids, self.block_size, self.max_blocks) if ids else ()
        return RoutingKey(blocks, session)
