"""The HTTP API of ``pdlife serve``: SGLang's worker endpoints, as the SGLang router calls them.

Every body is a pydantic model, so ``/openapi.json`` describes exactly what is accepted and
answered. Handlers never touch an engine: they check the input (:meth:`Service.check`), register
and submit (:meth:`Service.start`), and await the request's future (see :mod:`.core`
for the hand-off). A client that goes away aborts its requests.

Errors are answered as ``{"error": {"message", "type", "rid"}}`` with a 4xx for what the client
can fix (malformed JSON, wrong types, an empty or too long prompt, a bad ``max_new_tokens``, an
oversized body, an unknown rid to abort, a room in use) and 5xx/503 for what it cannot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.decode.router import PeerUnreachable
from scheduler.messages import FAKE_BOOTSTRAP_HOST
from scheduler.service.core import Answer, BadRequest, Item, Pending, Service, Unavailable
from scheduler.service.middleware import BodyLimit, HttpMetrics
from scheduler.service.schema import (
    ERRORS,
    AbortAnswer,
    AbortRequest,
    ErrorBody,
    ErrorDetail,
    FinishReason,
    GenerateAnswer,
    GenerateRequest,
    MetaInfo,
    ModelCard,
    ModelInfo,
    ModelList,
    SamplingParams,
    ServerInfo,
)

logger = logging.getLogger(__name__)

_HEALTH_TIMEOUT_S = 30.0
_ROUTES = frozenset({
    "/health", "/health_generate", "/server_info", "/get_server_info", "/model_info",
    "/get_model_info", "/v1/models", "/metrics", "/generate", "/abort_request", "/openapi.json",
})


def _error(status: int, kind: str, message: str, rid: str | None = None) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(message=message, type=kind, rid=rid))
    return JSONResponse(body.model_dump(), status_code=status)


# -- answers ----------------------------------------------------------------------------------


def _finish(answer: Answer) -> FinishReason:
    ids = answer.output_ids
    if answer.finish_reason == "abort":
        return FinishReason(type="abort", message=answer.message or "aborted",
                            status_code=answer.status)
    if answer.finish_reason == "length":
        return FinishReason(type="length", length=len(ids))
    return FinishReason(type="stop", matched=ids[-1] if ids else None)


def _answer_body(service: Service, rid: str, ids: Sequence[int], prompt_tokens: int,
                 latency: float, finish: FinishReason | None) -> dict[str, Any]:
    body = GenerateAnswer(
        text=service.tokenizer.decode(ids),
        output_ids=list(ids),
        meta_info=MetaInfo(
            id=rid, finish_reason=finish, prompt_tokens=prompt_tokens,
            completion_tokens=len(ids), e2e_latency=latency,
        ),
    ).model_dump()
    if finish is not None:  # SGLang's finish_reason carries only the keys of its type
        body["meta_info"]["finish_reason"] = finish.model_dump(exclude_none=True)
    return body


def _final_body(service: Service, answer: Answer) -> dict[str, Any]:
    return _answer_body(service, answer.rid, answer.output_ids, answer.prompt_tokens,
                        answer.e2e_latency, _finish(answer))


def _failure_kind(answer: Answer) -> str:
    return answer.reason.value if answer.reason is not None else "error"


# -- input ------------------------------------------------------------------------------------


def _per_item(value: Any, n: int, name: str, batch: bool) -> list[Any]:
    """A batch field: one value per prompt, or one value shared by all."""
    if isinstance(value, list):
        if not batch:
            raise BadRequest("bad_batch", f"{name} is a list but the prompt is not a batch")
        if len(value) != n:
            raise BadRequest("bad_batch", f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _items(service: Service, body: GenerateRequest) -> tuple[list[Item], bool]:
    if body.return_logprob:
        raise BadRequest("unsupported", "return_logprob is not supported by this server")
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("bad_prompt", "give exactly one of text or input_ids")
    prompts: list[list[int]]
    if body.text is not None:
        batch = isinstance(body.text, list)
        texts = body.text if isinstance(body.text, list) else [body.text]
        prompts = [service.tokenizer.encode(t) for t in texts]
    else:
        ids = body.input_ids
        assert ids is not None
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = [list(p) for p in ids] if batch else [list(ids)]  # type: ignore[arg-type]
    if batch and not prompts:
        raise BadRequest("empty_prompt", "the batch is empty")
    n = len(prompts)
    if isinstance(body.rid, list):
        rids = _per_item(body.rid, n, "rid", batch)
    elif body.rid is not None:
        rids = [body.rid] if not batch else [f"{body.rid}-{i}" for i in range(n)]
    else:
        base = uuid.uuid4().hex
        rids = [base] if not batch else [f"{base}-{i}" for i in range(n)]
    if len(set(rids)) != n:
        raise BadRequest("duplicate_rid", "the rids of a batch must be distinct")
    hosts = _per_item(body.bootstrap_host, n, "bootstrap_host", batch)
    ports = _per_item(body.bootstrap_port, n, "bootstrap_port", batch)
    rooms = _per_item(body.bootstrap_room, n, "bootstrap_room", batch)
    params = _per_item(body.sampling_params or SamplingParams(), n, "sampling_params", batch)
    items = [
        service.check(
            rid=rid, input_ids=prompt, max_new_tokens=sp.max_new_tokens,
            stop_token_ids=sp.stop_token_ids or (), ignore_eos=sp.ignore_eos,
            bootstrap_host=host, bootstrap_port=port, bootstrap_room=room,
        )
        for rid, prompt, sp, host, port, room in zip(
            rids, prompts, params, hosts, ports, rooms, strict=True
        )
    ]
    return items, batch


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- the app ----------------------------------------------------------------------------------


def create_app(service: Service) -> FastAPI:
    """The FastAPI app over ``service`` (whose engine loop the caller starts and stops)."""
    config = service.config
    app = FastAPI(
        title="pdlife worker",
        version="0.1.0",
        description="SGLang-worker-compatible API of a pdlife prefill or decode server.",
    )
    metrics = service.metrics

    def rejected(reason: str, status: int, message: str, rid: str | None = None) -> JSONResponse:
        metrics.http_rejected.labels(reason=reason).inc()
        return _error(status, reason, message, rid)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # a body FastAPI could not even decode
            return rejected("malformed_json", 400, f"the body is not valid JSON: {exc.detail}")
        return _error(exc.status_code, "http_error", str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        bad_json = [e for e in errors if e.get("type") == "json_invalid"]
        if bad_json:
            why = bad_json[0].get("ctx", {}).get("error", "")
            return rejected("malformed_json", 400, f"the body is not valid JSON: {why}")
        if "json" not in _request.headers.get("content-type", ""):
            return rejected("invalid_request", 400,
                            "send a JSON object with Content-Type: application/json")
        parts = [
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg', '')}"
            for e in errors[:5]
        ]
        return rejected("invalid_request", 400, "; ".join(parts) or "invalid request")

    def unavailable() -> JSONResponse | None:
        if not service.healthy:
            return _error(503, "unhealthy", f"the engine loop failed: {service.loop.failure!r}")
        if service.draining:
            return _error(503, "draining", "the server is draining (shutting down)")
        return None

    @app.get("/health", response_class=PlainTextResponse, responses={503: ERRORS[503]})
    async def health() -> Response:
        """200 (empty body) while the engine loop runs and the server admits requests."""
        return unavailable() or PlainTextResponse("")

    @app.get("/health_generate", response_class=PlainTextResponse,
             responses={503: ERRORS[503]})
    async def health_generate() -> Response:
        """Runs a one-token request through the engines (fake bootstrap host)."""
        refused = unavailable()
        if refused is not None:
            return refused
        item = service.check(
            rid=f"health-{uuid.uuid4().hex}", input_ids=service.tokenizer.encode("health"),
            max_new_tokens=1, stop_token_ids=(), ignore_eos=True,
            bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_port=None, bootstrap_room=None,
        )
        try:
            pending = service.start(item, stream=False)
        except Unavailable as exc:
            return _error(503, "unavailable", str(exc))
        try:
            answer = await asyncio.wait_for(asyncio.shield(pending.future), _HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            service.abort(item.rid)
            return _error(503, "timeout", f"no answer within {_HEALTH_TIMEOUT_S:g} s")
        if answer.status != 200:
            return _error(503, _failure_kind(answer), answer.message)
        return PlainTextResponse("")

    def server_info() -> ServerInfo:
        snap = service.snapshot
        return ServerInfo(
            role=config.role,
            backend=config.backend,
            disaggregation_mode=config.role if config.role != "both" else "null",
            model_path=config.model_name,
            page_size=config.scheduler.page_size,
            pool_pages=config.pool_pages,
            max_new_tokens_limit=config.new_tokens_limit,
            max_position=config.model.max_position,
            bootstrap_port=(
                int(service.bootstrap.address.rpartition(":")[2])
                if service.bootstrap is not None else None
            ),
            healthy=service.healthy,
            draining=service.draining,
            live_requests=service.live_requests(),
            requests=snap.get("requests", {}),
            kv_pool=snap.get("kv_pool", {}),
            peers=service.decode_kv.peers() if service.decode_kv is not None else [],
        )

    app.get("/server_info", response_model=ServerInfo)(server_info)
    app.get("/get_server_info", response_model=ServerInfo)(server_info)

    def model_info() -> ModelInfo:
        return ModelInfo(
            model_path=config.model_name, tokenizer_path=None, is_generation=True,
            vocab_size=config.model.vocab_size, max_position=config.model.max_position,
        )

    app.get("/model_info", response_model=ModelInfo)(model_info)
    app.get("/get_model_info", response_model=ModelInfo)(model_info)

    started = int(time.time())

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(
            id=config.model_name, created=started, owned_by="pdlife", root=config.model_name,
            max_model_len=config.model.max_position,
        )])

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        """Prometheus text: scheduler, decode and HTTP metrics."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/abort_request", response_model=AbortAnswer,
              responses={400: ERRORS[400], 404: {"model": ErrorBody,
                                                   "description": "no live request has this rid"}})
    async def abort_request(body: AbortRequest) -> Response:
        """Abort a live request by rid (or every live request with ``abort_all``)."""
        if body.abort_all:
            return JSONResponse(AbortAnswer(rid="", aborted=service.abort_all()).model_dump())
        if not body.rid:
            return rejected("bad_rid", 400, "give a rid, or abort_all: true")
        if not service.abort(body.rid):
            return rejected("unknown_rid", 404, f"no live request has rid {body.rid!r}", body.rid)
        return JSONResponse(AbortAnswer(rid=body.rid, aborted=1).model_dump())

    @app.post(
        "/generate",
        response_model=GenerateAnswer | list[GenerateAnswer],
        responses={
            200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                  "description": "the answer (a list for a batch), or a stream of answers"},
            **ERRORS,
        },
    )
    async def generate(body: GenerateRequest, request: Request) -> Response:
        """Generate for one prompt or a batch (SGLang's ``/generate``)."""
        refused = unavailable()
        if refused is not None:
            metrics.http_rejected.labels(reason="unavailable").inc()
            return refused
        try:
            items, batch = _items(service, body)
            if body.stream and batch:
                raise BadRequest("bad_batch", "streaming a batch is not supported")
        except BadRequest as exc:
            return rejected(exc.reason, exc.status, str(exc), exc.rid)
        try:
            for addr_item in {i.bootstrap_addr: i for i in items}.values():
                if service.needs_connect(addr_item):
                    await asyncio.to_thread(service.connect_peer, addr_item)
        except PeerUnreachable as exc:
            return rejected("bootstrap_failed", 500, str(exc))
        started: list[Pending] = []
        try:
            for item in items:
                started.append(service.start(item, stream=body.stream))
        except (BadRequest, Unavailable) as exc:
            for p in started:
                service.abort(p.item.rid)
            if isinstance(exc, BadRequest):
                return rejected(exc.reason, exc.status, str(exc), exc.rid)
            return rejected("unavailable", 503, str(exc))
        if body.stream:
            return StreamingResponse(_stream(service, started[0]),
                                     media_type="text/event-stream")
        return await _wait(service, request, started, batch)

    app.add_middleware(BodyLimit, limit=config.max_body_bytes,
                       on_reject=lambda: metrics.http_rejected.labels(reason="body_too_large")
                       .inc())
    app.add_middleware(HttpMetrics, metrics=metrics, routes=_ROUTES)
    return app


async def _wait(service: Service, request: Request, pending: list[Pending],
                batch: bool) -> Response:
    futures = [p.future for p in pending]
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        everything = asyncio.ensure_future(asyncio.gather(*futures))
        either: set[asyncio.Future[Any]] = {everything, gone}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():
            everything.cancel()
            for p in pending:
                service.abort(p.item.rid)
            logger.info("client went away; aborted %s", [p.item.rid for p in pending])
            return Response(status_code=499)
    finally:
        gone.cancel()
    answers: list[Answer] = [f.result() for f in futures]
    for answer in answers:
        if answer.status != 200:
            return _error(answer.status, _failure_kind(answer), answer.message, answer.rid)
    bodies = [_final_body(service, a) for a in answers]
    return JSONResponse(bodies if batch else bodies[0])


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _stream(service: Service, pending: Pending) -> AsyncIterator[bytes]:
    """SGLang's stream: cumulative ``text``/``output_ids`` per chunk, the last one with its
    ``finish_reason``, then ``data: [DONE]``. A client that disconnects aborts the request."""
    item, progress = pending.item, pending.progress
    assert progress is not None
    emitted: list[int] = []
    finished = False
    try:
        while not pending.future.done():
            more = asyncio.ensure_future(progress.get())
            either: set[asyncio.Future[Any]] = {more, pending.future}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not more.done():
                more.cancel()
                continue
            emitted.extend(more.result())
            yield _sse(_answer_body(service, item.rid, emitted, len(item.input_ids),
                                    time.monotonic() - pending.started, None))
        answer = pending.future.result()
        if answer.status != 200:
            yield _sse(ErrorBody(error=ErrorDetail(
                message=answer.message, type=_failure_kind(answer), rid=answer.rid)).model_dump())
        else:
            yield _sse(_final_body(service, answer))
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:
            service.abort(item.rid)
            logger.info("stream of %r closed early; aborted", item.rid)
