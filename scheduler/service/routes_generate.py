"""SGLang's request endpoints: ``/generate`` (one prompt or a batch, plain or streamed) and
``/abort_request``.

Handlers never touch an engine: they check the input (:meth:`Service.check`), register and
submit (:meth:`Service.start`), and await the request's future (see :mod:`.core` for the
hand-off). A client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lifecycle import SamplingParams
from scheduler.decode.router import PeerUnreachable
from scheduler.service.answers import answer_body, final_body
from scheduler.service.config import AnswerOptions
from scheduler.service.core import Answer, BadRequest, Item, Pending, Service, Unavailable
from scheduler.service.errors import error, failure_kind, rejected, unavailable_reason
from scheduler.service.refusals import peer_rooms, refuse_items, refuse_peers
from scheduler.service.routes_info import ServiceDep
from scheduler.service.sampling import sampling_params_from
from scheduler.service.schema import (
    ERRORS,
    AbortAnswer,
    AbortBody,
    ErrorBody,
    ErrorDetail,
    GenerateAnswer,
    GenerateRequest,
    SamplingParamsBody,
)

logger = logging.getLogger(__name__)

router = APIRouter()


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
    _refuse_unsupported(body)
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
    params = _per_item(body.sampling_params or SamplingParamsBody(), n, "sampling_params", batch)
    items = [
        attrs.evolve(service.check(
            rid=rid, input_ids=prompt, sampling=_sampling(service, body, sp, rid),
            bootstrap_host=host, bootstrap_port=port, bootstrap_room=room,
        ), options=AnswerOptions(sp.no_stop_trim, sp.skip_special_tokens,
                                 body.return_text_in_logprobs))
        for rid, prompt, sp, host, port, room in zip(
            rids, prompts, params, hosts, ports, rooms, strict=True
        )
    ]
    return items, batch


def _sampling(service: Service, body: GenerateRequest, sp: SamplingParamsBody,
              rid: str) -> SamplingParams:
    try:
        return sampling_params_from(
            sp, return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num,
            logprob_start_len=body.logprob_start_len,
            max_new_tokens_limit=service.config.new_tokens_limit)
    except BadRequest as exc:
        exc.rid = rid
        raise


#: Top-level SGLang fields pdlife cannot honour, with the value that asks for nothing.
_NEUTRAL_TOP: dict[str, Any] = {
    "token_ids_logprob": None, "return_hidden_states": False, "input_embeds": None,
    "image_data": None, "audio_data": None, "video_data": None, "lora_path": None,
    "custom_logit_processor": None, "session_params": None,
}


def _refuse_unsupported(body: GenerateRequest) -> None:
    for name, neutral in _NEUTRAL_TOP.items():
        value = getattr(body, name)
        if value != neutral:
            raise BadRequest("unsupported", f"{name} is not supported by this server "
                             f"(leave it out, or send {json.dumps(neutral)})")


def _trace_carrier(service: Service, request: Request) -> dict[str, str] | None:
    """The caller's W3C trace headers, when the service traces requests."""
    if service.tracer is None:
        return None
    return {k: request.headers[k] for k in ("traceparent", "tracestate") if k in request.headers}


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- routes -----------------------------------------------------------------------------------


@router.post("/abort_request", response_model=AbortAnswer,
             responses={400: ERRORS[400], 404: {"model": ErrorBody,
                                                  "description": "no live request has this rid"}})
async def abort_request(body: AbortBody, service: ServiceDep) -> Response:
    """Abort a live request by rid (or every live request with ``abort_all``)."""
    if body.abort_all:
        return JSONResponse(AbortAnswer(rid="", aborted=service.abort_all()).model_dump())
    if not body.rid:
        return rejected(service, "bad_rid", 400, "give a rid, or abort_all: true")
    if not service.abort(body.rid):
        return rejected(service, "unknown_rid", 404, f"no live request has rid {body.rid!r}",
                        body.rid)
    return JSONResponse(AbortAnswer(rid=body.rid, aborted=1).model_dump())


@router.post(
    "/generate",
    response_model=GenerateAnswer | list[GenerateAnswer],
    responses={
        200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
              "description": "the answer (a list for a batch), or a stream of answers"},
        **ERRORS,
    },
)
async def generate(body: GenerateRequest, request: Request, service: ServiceDep) -> Response:
    """Generate for one prompt or a batch (SGLang's ``/generate``)."""
    why = unavailable_reason(service)
    if why is not None:
        service.metrics.http_rejected.labels(reason="unavailable").inc()
        refuse_peers(service, peer_rooms(body.model_dump()), *why)
        return error(503, *why)
    try:
        items, batch = _items(service, body)
        if body.stream and batch:
            raise BadRequest("bad_batch", "streaming a batch is not supported")
    except BadRequest as exc:
        refuse_peers(service, peer_rooms(body.model_dump()), exc.reason, str(exc))
        return rejected(service, exc.reason, exc.status, str(exc), exc.rid)
    try:
        for addr_item in {i.bootstrap_addr: i for i in items}.values():
            if service.needs_connect(addr_item):
                await asyncio.to_thread(service.connect_peer, addr_item)
    except PeerUnreachable as exc:
        refuse_items(service, items, "bootstrap_failed", str(exc))
        return rejected(service, "bootstrap_failed", 500, str(exc))
    started: list[Pending] = []
    carrier = _trace_carrier(service, request)
    try:
        for item in items:
            started.append(service.start(item, stream=body.stream, carrier=carrier))
    except (BadRequest, Unavailable) as exc:
        for p in started:
            service.abort(p.item.rid)  # the engines tell their peers
        kind = exc.reason if isinstance(exc, BadRequest) else "unavailable"
        refuse_items(service, items[len(started):], kind, str(exc))
        if isinstance(exc, BadRequest):
            return rejected(service, exc.reason, exc.status, str(exc), exc.rid)
        return rejected(service, "unavailable", 503, str(exc))
    if body.stream:
        return StreamingResponse(_stream(service, started[0]), media_type="text/event-stream")
    return await _wait(service, request, started, batch)


async def _wait(service: Service, request: Request, pending: list[Pending],
                batch: bool) -> Response:
    """Every answer of ``pending``, or 499 and an abort of them all if the client goes away
    first. Only the answers' own futures are awaited (nothing wraps them that a cancellation
    could leave unretrieved)."""
    futures = [p.future for p in pending]
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        while waiting := [f for f in futures if not f.done()]:
            either: set[asyncio.Future[Any]] = {*waiting, gone}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if gone.done() and not all(f.done() for f in futures):
                for p in pending:
                    service.abort(p.item.rid)
                logger.info("client went away; aborted %s", [p.item.rid for p in pending])
                return Response(status_code=499)
    finally:
        gone.cancel()
    answers: list[Answer] = [f.result() for f in futures]
    for answer in answers:
        if answer.status != 200:
            return error(answer.status, failure_kind(answer), answer.message, answer.rid)
    bodies = [final_body(service.tokenizer, p.item, a) for p, a in zip(pending, answers,
                                                                        strict=True)]
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
            yield _sse(answer_body(service.tokenizer, item, ids=emitted,
                                   prompt_tokens=len(item.input_ids),
                                   latency=time.monotonic() - pending.started, finish=None))
        answer = pending.future.result()
        if answer.status != 200:
            yield _sse(ErrorBody(error=ErrorDetail(
                message=answer.message, type=failure_kind(answer), rid=answer.rid)).model_dump())
        else:
            yield _sse(final_body(service.tokenizer, item, answer))
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:
            service.abort(item.rid)
            logger.info("stream of %r closed early; aborted", item.rid)
