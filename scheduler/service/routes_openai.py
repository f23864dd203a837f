"""The OpenAI endpoints: ``/v1/completions`` and ``/v1/chat/completions``, plain or streamed.

Both run on either worker role with the body a PD router sends (its bootstrap fields added):
the decode worker answers the whole completion, the prefill worker (whose answer the router
drops) a completion of its one token, as ``/generate`` does. Every error, including a body that
is not JSON or fails the schema, is OpenAI's error object ``{"error": {"message", "type",
"param", "code"}}``: ``type`` ``invalid_request_error`` for a 4xx, ``server_error`` otherwise;
``code`` is the reason ``/generate`` would give (``unsupported``, ``prompt_too_long``,
``draining``, ``transfer_failed``, ...); ``param`` names the field to change, when there is one.
A refusal is told to the request's peer, as on ``/generate``.

``n`` > 1 runs ``n`` requests, one per choice (:func:`~.openai_request.chat_items`), and a
batch of completion prompts ``n`` per prompt, prompt-major; a stream interleaves their chunks
as they come, each carrying its choice's ``index``, and the usage covers them all. An echoed
prompt's text (with its logprobs) is the first text chunk of its choice.
"""

from __future__ import annotations

import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import attrs
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.sample.stops import StopRegexTooSlow
from scheduler.service import handoff
from scheduler.service.answers import final_text
from scheduler.service.core import Answer, Item, Pending, Service
from scheduler.service.errors import failure_kind, openai_error, plain_validation_errors
from scheduler.service.openai_format import (
    Chunks,
    StreamLogprobs,
    StreamText,
    answer_body,
    now,
)
from scheduler.service.openai_request import chat_items, completion_items
from scheduler.service.openai_schema import (
    OPENAI_ERRORS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    OpenAIError,
    SamplingFields,
)
from scheduler.service.openai_tools import ToolStream
from scheduler.service.refusals import peer_rooms, refuse_peers
from scheduler.service.routes_info import ServiceDep, service_of

Body = TypeVar("Body", bound=SamplingFields)


def _refused(service: Service, refusal: handoff.Refusal, rid: str) -> JSONResponse:
    """The refusal as an OpenAI error, with the request's id in OpenAI's header (a body the
    route could not read gets a fresh one, as any request has an id)."""
    handoff.count(service, refusal)
    response = openai_error(refusal.status, str(refusal), refusal.kind, refusal.param)
    response.headers["x-request-id"] = _header_id(rid)
    return response


def _header_id(rid: str) -> str:
    """``rid`` as a header value: a client's rid may hold what a header cannot carry (beyond
    Latin-1, control characters), which is percent-encoded."""
    return rid if rid.isascii() and rid.isprintable() else urllib.parse.quote(rid, safe="")


def _new_rid(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


class OpenAIRoute(APIRoute):
    """A route whose refusals of the body itself (not JSON, not the schema) are OpenAI errors
    too; the app's handlers would answer them in ``/generate``'s shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handle(request)
            except RequestValidationError as exc:
                return _invalid(service_of(request), request, exc)
            except StarletteHTTPException as exc:
                if exc.status_code != 400:
                    raise
                return _refused(service_of(request), handoff.Refusal(
                    "malformed_json", 400, f"the body is not valid JSON: {exc.detail}"),
                    _new_rid(request.url.path.endswith("chat/completions")))

        return route


def _invalid(service: Service, request: Request, exc: RequestValidationError) -> JSONResponse:
    given = exc.body.get("rid") if isinstance(exc.body, dict) else None
    rid = given if isinstance(given, str) and 0 < len(given) <= 256 else _new_rid(
        request.url.path.endswith("chat/completions"))
    errors = exc.errors()
    bad_json = [e for e in errors if e.get("type") == "json_invalid"]
    if bad_json:
        why = bad_json[0].get("ctx", {}).get("error", "")
        return _refused(service, handoff.Refusal("malformed_json", 400,
                                                 f"the body is not valid JSON: {why}"), rid)
    if "json" not in request.headers.get("content-type", ""):
        return _refused(service, handoff.Refusal(
            "invalid_request", 400, "send a JSON object with Content-Type: application/json"),
            rid)
    messages = plain_validation_errors(errors)
    message = "; ".join(messages[:5]) or "invalid request"
    param = messages[0].partition(":")[0] if messages else None
    refuse_peers(service, peer_rooms(exc.body), "invalid_request", 400, message)
    return _refused(service, handoff.Refusal("invalid_request", 400, message, param=param), rid)


router = APIRouter(route_class=OpenAIRoute)


def _responses(what: str) -> dict[int | str, dict[str, Any]]:
    return {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                  "description": f"the {what}, or a stream of chunks"}, **OPENAI_ERRORS}


@router.post("/v1/completions", response_model=CompletionResponse,
             responses=_responses("completion"))
async def completions(body: CompletionRequest, request: Request,
                      service: ServiceDep) -> Response:
    """OpenAI's completions: a prompt (text or token ids) or a batch of them."""
    return await _serve(service, request, body, completion_items, chat=False)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=_responses("chat completion"))
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           service: ServiceDep) -> Response:
    """OpenAI's chat completions: the messages through the model's chat template."""
    return await _serve(service, request, body, chat_items, chat=True)


async def _serve(service: Service, request: Request, body: Body,
                 build: Callable[[Service, Body], list[Item]], *, chat: bool) -> Response:
    created = now()  # when the request arrived: the answer's and every chunk's ``created``
    model = body.model or service.config.model_name
    # The answer's id, on a refusal too: the request's rid, which choice i's ``<rid>_<i>``
    # extends when there are several; OpenAI's header of it (the client's ``_request_id``).
    rid = body.rid = body.rid or _new_rid(chat)
    headers = {"x-request-id": _header_id(rid)}
    try:
        items = await handoff.checked(
            service, body, lambda: service.prepare_grammars(build(service, body)))
        started = await handoff.admit(service, request, items, stream=body.stream)
    except handoff.Refusal as refusal:
        return _refused(service, refusal, rid)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = _stream(service, started, Chunks(rid, model, chat, created=created,
                                                    include_usage=include_usage),
                         body.n)
        return StreamingResponse(handoff.events(service, started, chunks),
                                 media_type="text/event-stream", headers=headers)
    answers = await handoff.answered(service, request, started, lambda a: openai_error(
        a.status, a.message, failure_kind(a)))
    if isinstance(answers, Response):
        answers.headers.update(headers)
        return answers
    try:
        answered = answer_body(service.tokenizer, rid, list(zip(items, answers, strict=True)),
                               model, chat=chat, created=created, n=body.n)
    except StopRegexTooSlow as exc:  # cutting an answer at its stop ran past the budget
        response = openai_error(400, str(exc), "rejected")
        response.headers.update(headers)
        return response
    return JSONResponse(answered, headers=headers)


async def _stream(service: Service, started: list[Pending], chunks: Chunks,
                  n: int) -> AsyncIterator[dict[str, Any]]:
    """The chunks of every choice as they come, then the usage of all if asked."""
    streams = [_chunks(service, p, attrs.evolve(chunks, index=i)) for i, p in enumerate(started)]
    async for chunk in handoff.merged(streams):
        yield chunk
    answers = [p.future.result() for p in started]
    if chunks.include_usage and all(a.status == 200 for a in answers):
        yield chunks.usage(answers, n)


async def _chunks(service: Service, pending: Pending,
                  chunks: Chunks) -> AsyncIterator[dict[str, Any]]:
    """The chunks of one choice: an echoed prompt once its logprobs are known (with the first
    tokens, or the answer), text only once it cannot change (:class:`StreamText`), with
    the logprobs of the tokens whose text it completes (:class:`StreamLogprobs`), the last with
    the finish reason and the remaining logprobs; or an error."""
    try:
        async for chunk in _choice_chunks(service, pending, chunks):
            yield chunk
    except StopRegexTooSlow as exc:  # its text cannot be cut in time: the choice fails
        service.abort(pending.item.rid)
        await pending.future  # its answer, the abort's, lands before the stream ends
        yield OpenAIError.of(400, str(exc), "rejected").model_dump()


async def _choice_chunks(service: Service, pending: Pending,
                         chunks: Chunks) -> AsyncIterator[dict[str, Any]]:
    item, tokenizer = pending.item, service.tokenizer
    text = StreamText(tokenizer, item)
    tools = None if item.options.tools is None else ToolStream(item.options.tools)
    logprobs = StreamLogprobs(tokenizer, item, chat=chunks.chat)
    opening = chunks.opening(text=tools is None or tools.may_write_text)
    if opening is not None:
        yield opening
    echo = item.options.echo
    shown = ""  # the content sent, with tools (which hold back what may begin a call)
    async for progress in handoff.new_tokens(pending):
        if echo is not None:  # a colocated worker's input logprobs come before any token
            yield chunks.text(echo, logprobs=logprobs.echo(pending.input_logprobs, echo))
            echo = None
        logprobs.more(progress.logprobs)
        delta = text.more(progress.tokens)
        if tools is not None:
            delta = tools.more(delta)
            shown += delta
        if delta:
            released = text.released if tools is None else text.released_within(shown)
            yield chunks.text(delta, logprobs=logprobs.upto(released))
    answer: Answer = pending.future.result()
    if echo is not None and answer.status == 200:
        yield chunks.text(echo, logprobs=logprobs.echo(answer.input_logprobs, echo))
    if answer.status != 200:
        yield OpenAIError.of(answer.status, answer.message, failure_kind(answer)).model_dump()
        return
    final = final_text(tokenizer, item, answer)
    if tools is None:
        yield chunks.text(text.rest(final), finish=answer.finish_reason,
                          logprobs=logprobs.rest(answer))
        return
    rest, read = tools.end(final, answer.finish_reason)
    if read.calls:
        if rest:
            yield chunks.text(rest)
        yield chunks.tool_calls(read.calls)
        rest = ""
    yield chunks.text(rest, finish=read.finish_reason, logprobs=logprobs.rest(answer))
