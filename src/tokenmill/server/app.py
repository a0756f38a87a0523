"""The app factory: routes of every API over one ModelHost, shared error rendering, and a lifespan
that shuts the engine down when the server stops."""
from __future__ import annotations

import contextlib
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.config import Config
from tokenmill.server import (access, anthropic_messages, blobs, metrics, ollama, ollama_models, openai,
                              openai_responses, openapi, runner_api, runner_info)
from tokenmill.server.errors import APIError, handle_api_error, handle_http_exception, handle_unexpected
from tokenmill.server.model_host import ModelHost
from tokenmill.server.streaming import ClientGone
from tokenmill.store.pull import Fetcher

log = logging.getLogger("tokenmill.server")


class ReleaseLeases:
    """Releases the model leases a request took (model_host.model_for) once its response is over:
    after the last byte of a stream, on a disconnect or on an error alike."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        finally:
            for lease in scope.pop("tokenmill.leases", ()):
                lease.release()


async def _client_gone(request: Request, exc: Exception) -> Response:
    # Nobody reads this; 499 (nginx's "client closed request") keeps access logs honest.
    return Response(status_code=499)


def create_app(host: ModelHost, settings: Config | None = None, *, fetcher: Fetcher | None = None,
               shutdown_host: bool = True) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        if shutdown_host:
            host.shutdown()

    settings = settings or Config()
    app = Starlette(
        routes=[*runner_api.routes(), *runner_info.routes(), *ollama_models.routes(), *blobs.routes(),
                *ollama.routes(), *openai.routes(), *openai_responses.routes(), *anthropic_messages.routes(),
                *metrics.routes(), *openapi.routes()],
        exception_handlers={
            APIError: handle_api_error,
            HTTPException: handle_http_exception,
            ClientGone: _client_gone,
            Exception: handle_unexpected,
        },
        # The Host guard follows the address the server is configured to listen on (settings.host), so a
        # Ray replica behind a loopback proxy is guarded as `tokenmill serve` is. An app driven in
        # process (starlette's TestClient says `Host: testserver`) must send a loopback Host too.
        middleware=[*access.middleware(settings.api_key, settings.origins, settings.max_body_bytes,
                                       settings.body_timeout, listen_host=settings.host,
                                       allowed_hosts=settings.allowed_hosts),
                    Middleware(ReleaseLeases)],
        lifespan=lifespan,
    )
    app.state.host = host
    app.state.settings = settings  # what /load starts from
    app.state.fetcher = fetcher  # None = pip; tests pass a fake index
    return app
