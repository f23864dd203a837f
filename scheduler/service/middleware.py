"""ASGI middleware of the ``pdlife serve`` app: HTTP/2 probes, the API key, the body-size
limit, ``Retry-After`` on 503 answers and the HTTP metrics. Each acts on HTTP requests only
(:class:`HttpMiddleware`); other scopes pass through untouched."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from scheduler.service.metrics import ServiceMetrics
from scheduler.service.openai_schema import OpenAIError
from scheduler.service.schema import ErrorBody, ErrorDetail

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


#: How much of an oversized body is read and thrown away before the 413, so that a client that
#: sends its whole body before reading sees the answer instead of a reset connection.
_DISCARD_LIMIT = 64 << 20


class HttpMiddleware:
    """Middleware over ``app`` that handles HTTP requests in :meth:`http` and passes every other
    scope (lifespan, websockets) to ``app`` as it is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class Http2Probe(HttpMiddleware):
    """Answers an HTTP/2 prior-knowledge probe (``PRI *``, which SGLang's router sends to find
    out whether a worker speaks HTTP/2) with 505 and a closed connection, before any metrics
    count it: the probe is not a request of a client."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("method") == "PRI":
            await send({"type": "http.response.start", "status": 505, "headers": [
                (b"content-length", b"0"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)


def _error_response(scope: Scope, status: int, kind: str, message: str,
                    headers: tuple[tuple[bytes, bytes], ...] = ()) -> tuple[Message, Message]:
    """The start and body messages of an error answer in the shape of the route's API: OpenAI's
    error object (``kind`` as its ``code``) under ``/v1/``, ``/generate``'s elsewhere."""
    error: ErrorBody | OpenAIError
    if str(scope.get("path", "")).startswith("/v1/"):
        error = OpenAIError.of(status, message, kind)
    else:
        error = ErrorBody(error=ErrorDetail(message=message, type=kind))
    data = json.dumps(error.model_dump())
    start = {"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *headers]}
    return start, {"type": "http.response.body", "body": data.encode()}


#: Routes open without the API key: the health probes (SGLang's router sends them without one).
OPEN_ROUTES = frozenset({"/health", "/health_generate"})


class ApiKey(HttpMiddleware):
    """Every route but ``open_routes`` requires ``Authorization: Bearer <key>`` (SGLang's
    ``--api-key``; OpenAI clients send it so). Anything else is answered 401 with the API's error
    body before the app, or the body limit, reads a byte of the body; the key is compared in
    constant time."""

    def __init__(self, app: ASGIApp, key: str, on_reject: Callable[[], None],
                 open_routes: frozenset[str] = OPEN_ROUTES) -> None:
        if not key:
            raise ValueError("the API key must not be empty")
        super().__init__(app)
        self.key = key.encode()
        self.on_reject = on_reject
        self.open_routes = open_routes

    def authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope.get("headers") or () if k == b"authorization"), b"")
        scheme, _, credentials = bytes(header).partition(b" ")
        # compare_digest on bytes of any length; a wrong scheme still costs the comparison.
        match = hmac.compare_digest(credentials.strip(), self.key)
        return match and scheme.lower() == b"bearer"

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("path", "") in self.open_routes or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        self.on_reject()
        start, body = _error_response(
            scope, 401, "unauthorized",
            "missing or wrong API key: send the header Authorization: Bearer <key>",
            ((b"www-authenticate", b"Bearer"), (b"connection", b"close")))
        await send(start)
        await send(body)


class RetryAfter(HttpMiddleware):
    """Adds ``Retry-After`` to every 503 answer that has none: the server is draining, failed
    or overloaded (:mod:`.shedding`), and a client or router should come back later or go
    elsewhere."""

    def __init__(self, app: ASGIApp, seconds: int) -> None:
        super().__init__(app)
        self.value = str(seconds).encode()

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_header(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers") or ())
                if not any(k.lower() == b"retry-after" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"retry-after", self.value)]}
            await send(message)

        await self.app(scope, receive, with_header)


class BodyLimit(HttpMiddleware):
    """Answers 413 to a body over ``limit`` bytes before the app sees any of it."""

    def __init__(self, app: ASGIApp, limit: int, on_reject: Callable[[], None]) -> None:
        super().__init__(app)
        self.limit = limit
        self.on_reject = on_reject

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._reject(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._reject(scope, receive, send, more=message.get("more_body", False))
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, more: bool = True
                      ) -> None:
        self.on_reject()
        discarded = 0
        while more and discarded <= _DISCARD_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                break
            discarded += len(message.get("body", b""))
            more = message.get("more_body", False)
        start, body = _error_response(
            scope, 413, "body_too_large", f"the request body exceeds {self.limit} bytes",
            ((b"connection", b"close"),))
        await send(start)
        await send(body)


class HttpMetrics(HttpMiddleware):
    """Counts every answer by route, method and status; times it to its first byte. A route
    with a parameter (``/v1/models/{model}``) is one label for every path it matches; a path
    of no route is ``other``."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, routes: frozenset[str]) -> None:
        super().__init__(app)
        self.metrics = metrics
        self.routes = routes
        self.templates = tuple((r.split("{", 1)[0], r) for r in sorted(routes) if "{" in r)

    def _route(self, path: str) -> str:
        if path in self.routes:
            return path
        return next((route for prefix, route in self.templates
                     if path.startswith(prefix) and len(path) > len(prefix)), "other")

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        route = self._route(path)
        start = time.monotonic()

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(
                    route=route, method=scope.get("method", ""), status=str(message["status"])
                ).inc()
                self.metrics.http_seconds.labels(route=route).observe(time.monotonic() - start)
            await send(message)

        await self.app(scope, receive, counted)
