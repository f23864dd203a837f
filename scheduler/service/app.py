"""The HTTP API of ``pdlife serve``: SGLang's worker endpoints, as the SGLang router calls them.

Every body is a pydantic model, so ``/openapi.json`` describes exactly what is accepted and
answered. The routes live in :mod:`.routes_info` (health, info, models, metrics) and
:mod:`.routes_generate` (``/generate``, ``/abort_request``) and :mod:`.routes_openai`
(``/v1/completions``, ``/v1/chat/completions``); errors and refusals in
:mod:`.errors`. Each route finds its :class:`~.core.Service` on ``app.state``.

Errors are answered as ``{"error": {"message", "type", "rid"}}`` with a 4xx for what the client
can fix (malformed JSON, wrong types, an empty or too long prompt, a bad ``max_new_tokens``, an
oversized body, an unknown rid to abort, a room in use) and 5xx/503 for what it cannot; every
503 carries ``Retry-After``. With an API key, every route but the health probes requires it: the
check is middleware (:class:`.middleware.ApiKey`), so a route added later is covered too.
"""

from __future__ import annotations

from fastapi import FastAPI

from scheduler.service import routes_generate, routes_info, routes_openai
from scheduler.service.core import Service
from scheduler.service.errors import install_error_handlers
from scheduler.service.middleware import ApiKey, BodyLimit, Http2Probe, HttpMetrics, RetryAfter
from scheduler.service.shedding import RETRY_AFTER_S

_ROUTES = frozenset({
    "/health", "/health_generate", "/server_info", "/get_server_info", "/model_info",
    "/get_model_info", "/v1/models", "/metrics", "/generate", "/abort_request", "/openapi.json",
    "/v1/completions", "/v1/chat/completions", "/v1/models/{model}",
})


def create_app(service: Service) -> FastAPI:
    """The FastAPI app over ``service`` (whose engine loop the caller starts and stops)."""
    app = FastAPI(
        title="pdlife worker",
        version="0.1.0",
        description="SGLang-worker-compatible API of a pdlife prefill or decode server.",
    )
    app.state.service = service
    install_error_handlers(app, service)
    app.include_router(routes_info.router)
    app.include_router(routes_generate.router)
    app.include_router(routes_openai.router)
    metrics = service.metrics
    app.add_middleware(BodyLimit, limit=service.config.max_body_bytes,
                       on_reject=lambda: metrics.http_rejected.labels(reason="body_too_large")
                       .inc())
    if service.config.api_key is not None:  # before the body limit: no body read for a stranger
        app.add_middleware(ApiKey, key=service.config.api_key,
                           on_reject=lambda: metrics.http_rejected.labels(reason="unauthorized")
                           .inc())
    app.add_middleware(RetryAfter, seconds=RETRY_AFTER_S)
    app.add_middleware(HttpMetrics, metrics=metrics, routes=_ROUTES)
    app.add_middleware(Http2Probe)  # outermost: probes are neither counted nor routed
    return app
