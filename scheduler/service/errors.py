"""Errors as the HTTP API answers them, and the refusals every route shares.

Every error is ``{"error": {"message", "type", "rid"}}``: a 4xx for what the client can fix, a
5xx or 503 for what it cannot. Refusals of client input are counted by reason
(``pdlife_http_rejected_total``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.service.core import Answer, Service
from scheduler.service.openai_schema import OpenAIError
from scheduler.service.refusals import peer_rooms, refuse_peers
from scheduler.service.schema import ErrorBody, ErrorDetail


def error(status: int, kind: str, message: str, rid: str | None = None) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(message=message, type=kind, rid=rid))
    return JSONResponse(body.model_dump(), status_code=status)


def openai_error(status: int, message: str, code: str, param: str | None = None
                 ) -> JSONResponse:
    """OpenAI's error object: ``type`` ``invalid_request_error`` for a 4xx, ``server_error``
    otherwise."""
    return JSONResponse(OpenAIError.of(status, message, code, param).model_dump(),
                        status_code=status)


def rejected(
    service: Service, reason: str, status: int, message: str, rid: str | None = None
) -> JSONResponse:
    """A refusal of the client's input, counted by ``reason``."""
    service.metrics.http_rejected.labels(reason=reason).inc()
    return error(status, reason, message, rid)


def unavailable_reason(service: Service) -> tuple[str, str] | None:
    """Why the server cannot take requests now (kind, message), or None when it can."""
    unhealthy = service.unhealthy()
    if unhealthy:
        return "unhealthy", unhealthy
    if service.draining:
        return "draining", "the server is draining (shutting down)"
    starting = service.starting()
    if starting:
        return "starting", starting
    return None


def unavailable(service: Service) -> JSONResponse | None:
    """The 503 of a server that cannot take requests now, or None when it can."""
    why = unavailable_reason(service)
    return None if why is None else error(503, *why)


def failure_kind(answer: Answer) -> str:
    if answer.kind is not None:
        return answer.kind
    return answer.reason.value if answer.reason is not None else "error"


def _is_union_tag(part: object) -> bool:
    """A pydantic location part that names a union member (``list[int]``, ``SamplingParamsBody``,
    ``str``, ``constrained-int``) rather than a field (the API's fields are snake_case)."""
    return isinstance(part, str) and (
        "[" in part or "-" in part or part[:1].isupper()
        or part in ("str", "int", "float", "bool")
    )


def _type_name(tag: str) -> str:
    """A union member's name as a client reads it: ``constrained-int`` is an ``int``."""
    return tag.replace("constrained-", "")


def _is_type_mismatch(error: dict[str, Any]) -> bool:
    kind = str(error.get("type", ""))
    return kind.endswith(("_type", "_parsing"))


def plain_validation_errors(errors: Sequence[Any]) -> list[str]:
    """One plain message per field, from pydantic's errors.

    A field whose type is a union (``text``: a string or a list of strings) gets an error from
    every member. Where the value has one member's type and breaks that member's constraint,
    only that error is kept (``max_new_tokens: -1`` says ``>= 0``, not "not a list"); where the
    value has none of the types, the field gets one message naming them. Where the value is an
    object of a member that is a model (``sampling_params``: a body or a list of them), only
    that member's errors count, read the same way (``sampling_params.stop: should be one of
    list[str], str``).
    """
    by_field: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    into_model: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for error in errors:
        loc = list(error.get("loc", ()))[1:]  # drop "body"
        cut = next((i for i, part in enumerate(loc) if _is_union_tag(part)), len(loc))
        root = ".".join(str(p) for p in loc[:cut]) or "body"
        tag = str(loc[cut]) if cut < len(loc) else ""
        where = ".".join([root, *(str(p) for p in loc[cut + 1:] if not _is_union_tag(p))])
        by_field.setdefault(root, []).append((tag, where, error))
        field = next((p for p in loc[cut + 1:] if not isinstance(p, int)), None)
        if isinstance(field, str) and not _is_union_tag(field):
            # A field of the member (of an item of it): the value is that model's object.
            inner = {**error, "loc": ("body", *loc[:cut], *loc[cut + 1:])}
            into_model.setdefault(root, {}).setdefault(tag, []).append(inner)
    messages: list[str] = []
    for root, found in by_field.items():
        models = into_model.get(root, {})
        if len(models) == 1:
            messages.extend(plain_validation_errors(next(iter(models.values()))))
            continue
        tags = sorted({_type_name(tag) for tag, _, _ in found if tag})
        relevant = [(where, e) for _, where, e in found if not _is_type_mismatch(e)]
        if relevant or len(tags) < 2:
            chosen = relevant or [(where, e) for _, where, e in found]
            messages.extend(f"{where}: {e.get('msg', '')}" for where, e in chosen)
        else:
            messages.append(f"{root}: should be one of {', '.join(tags)}")
    return messages


def install_error_handlers(app: FastAPI, service: Service) -> None:
    """Answer what FastAPI refuses before a handler runs in the API's own error shape."""

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400:  # a body FastAPI could not even decode
            return rejected(service, "malformed_json", 400,
                            f"the body is not valid JSON: {exc.detail}")
        if request.url.path.startswith("/v1/"):  # what OpenAI clients read
            what = f"{request.method} {request.url.path}: {exc.detail}"
            return openai_error(exc.status_code, what,
                                str(exc.detail).lower().replace(" ", "_"))
        return error(exc.status_code, "http_error",
                     f"{request.method} {request.url.path}: {exc.detail}")

    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        bad_json = [e for e in errors if e.get("type") == "json_invalid"]
        if bad_json:
            why = bad_json[0].get("ctx", {}).get("error", "")
            return rejected(service, "malformed_json", 400, f"the body is not valid JSON: {why}")
        if "json" not in request.headers.get("content-type", ""):
            return rejected(service, "invalid_request", 400,
                            "send a JSON object with Content-Type: application/json")
        message = "; ".join(plain_validation_errors(errors)[:5]) or "invalid request"
        refuse_peers(service, peer_rooms(exc.body), "invalid_request", 400, message)
        return rejected(service, "invalid_request", 400, message)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid)
