"""ASGI middleware of the ``pdlife serve`` app: HTTP/2 probes, the body-size limit and the
HTTP metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from scheduler.service.metrics import ServiceMetrics
from scheduler.service.schema import ErrorBody, ErrorDetail

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


#: How much of an oversized body is read and thrown away before the 413, so that a client that
#: sends its whole body before reading sees the answer instead of a reset connection.
_DISCARD_LIMIT = 64 << 20


class Http2Probe:
    """Answers an HTTP/2 prior-knowledge probe (``PRI *``, which SGLang's router sends to find
    out whether a worker speaks HTTP/2) with 505 and a closed connection, before any metrics
    count it: the probe is not a request of a client."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "PRI":
            await send({"type": "http.response.start", "status": 505, "headers": [
                (b"content-length", b"0"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Answers 413 to a body over ``limit`` bytes before the app sees any of it."""

    def __init__(self, app: ASGIApp, limit: int, on_reject: Callable[[], None]) -> None:
        self.app = app
        self.limit = limit
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._reject(receive, send)
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
                await self._reject(receive, send, more=message.get("more_body", False))
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

    async def _reject(self, receive: Receive, send: Send, more: bool = True) -> None:
        self.on_reject()
        discarded = 0
        while more and discarded <= _DISCARD_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                break
            discarded += len(message.get("body", b""))
            more = message.get("more_body", False)
        body = ErrorBody(error=ErrorDetail(
            message=f"the request body exceeds {self.limit} bytes", type="body_too_large"))
        data = json.dumps(body.model_dump()).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})


class HttpMetrics:
    """Counts every answer by route, method and status; times it to its first byte."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, routes: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in self.routes else "other"
        start = time.monotonic()

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(
                    route=route, method=scope.get("method", ""), status=str(message["status"])
                ).inc()
                self.metrics.http_seconds.labels(route=route).observe(time.monotonic() - start)
            await send(message)

        await self.app(scope, receive, counted)
