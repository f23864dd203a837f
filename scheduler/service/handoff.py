"""What a generating route does between checking its input and answering, whatever its API:
admit the checked items, then wait for their answers (or the client's going away), or follow a
stream's new tokens.

Theory of operation: :func:`checked` refuses a body while the server takes no requests, then
builds the route's items from it (on a worker thread); what building refuses is told to the
body's peers and raised as a :class:`Refusal`. :func:`admit` connects the decode role to the
prefill servers the items name (a first look-up runs on the router's thread for that address;
the handler waits for its outcome, and stops waiting when the server drains, when the look-up
outlasts its time, or when the client goes away), then registers and submits each item
(:meth:`Service.start`). What it refuses it raises as :class:`Refusal`,
after telling the items' peers (:mod:`.refusals`) and aborting what it had already started, so
the route only has to answer the refusal in its own error shape. :func:`wait` returns the
answers, or None when the client went away first (its requests are aborted). :func:`new_tokens`
yields the tokens the decode side produced after every pass, with their logprobs when the
request asked for them (:class:`~.pending.Progress`), until the request's future is resolved;
the route reads the final :class:`Answer` from the future, and aborts the request if its stream
is closed before that. :func:`answered` is :func:`wait` for a route that answers all or nothing:
the answers, or the response to send instead. :func:`merged` interleaves the streams of a
request's samples (``n`` > 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import attrs
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from scheduler.decode.router import PeerUnreachable
from scheduler.service.core import Answer, BadRequest, Item, Pending, Service, Unavailable
from scheduler.service.errors import unavailable_reason
from scheduler.service.pending import Progress
from scheduler.service.refusals import peer_rooms, refuse_items, refuse_peers

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Refusal(Exception):
    """A request the service will not run: ``kind`` is the error type, ``status`` the HTTP
    status, ``param`` the request field to change (when one is to blame), ``label`` the
    ``pdlife_http_rejected_total`` reason (``kind`` unless said)."""

    def __init__(self, kind: str, status: int, message: str, rid: str | None = None, *,
                 param: str | None = None, label: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.rid = rid
        self.param = param
        self.label = label or kind

    @classmethod
    def of(cls, exc: BadRequest) -> Refusal:
        return cls(exc.reason, exc.status, str(exc), exc.rid, param=exc.param, label=exc.label)


#: The rids a log line names at most (a batch may hold 100,000 prompts).
SHOWN_RIDS = 8


def shown_rids(items: Iterable[Item]) -> str:
    """The rids of ``items`` for a log line: the first :data:`SHOWN_RIDS`, then a count."""
    rids = [item.rid for item in items]
    more = f" and {len(rids) - SHOWN_RIDS} more" if len(rids) > SHOWN_RIDS else ""
    return f"{rids[:SHOWN_RIDS]}{more}"


def check_available(service: Service, rooms: Iterator[tuple[str, int, int]]) -> None:
    """:class:`Refusal` (503) when the server takes no requests now; the peers of ``rooms``
    are told."""
    why = unavailable_reason(service)
    if why is not None:
        refuse_peers(service, rooms, why[0], 503, why[1])
        raise Refusal(why[0], 503, why[1])


async def checked(service: Service, body: BaseModel, build: Callable[[], T]) -> T:
    """What ``build`` makes of ``body`` when the server takes requests, or :class:`Refusal`
    (503 from :func:`check_available`, or ``build``'s :class:`BadRequest`, with the field it
    names); either way the body's peers are told. ``build`` runs off the event loop:
    it tokenizes, renders chat templates and compiles grammars, milliseconds each for a long
    prompt or a large schema, which would hold up every other request's handler."""
    fields = body.model_dump()
    check_available(service, peer_rooms(fields))
    try:
        return await asyncio.to_thread(build)
    except BadRequest as exc:
        refuse_peers(service, peer_rooms(fields), exc.reason, exc.status, str(exc))
        raise Refusal.of(exc) from exc


def count(service: Service, refusal: Refusal) -> None:
    """Count a refusal (``pdlife_http_rejected_total``, by its label)."""
    service.metrics.http_rejected.labels(reason=refusal.label).inc()


async def admit(service: Service, request: Request, items: list[Item], *,
                stream: bool) -> list[Pending]:
    """Start ``items`` (see the module's theory), or :class:`Refusal`."""
    looked_up = [i for i in items if service.needs_connect(i)]
    if looked_up:
        await _look_up(service, request, items, looked_up)
    started: list[Pending] = []
    carrier = trace_carrier(service, request)
    parents = spawned_by([item.rid for item in items])
    try:
        for item, spawners in zip(items, parents, strict=True):
            started.append(service.start(item, stream=stream, carrier=carrier,
                                         spawned_by=spawners))
    except (BadRequest, Unavailable) as exc:
        for p in started:
            service.abort(p.item.rid)  # the engines tell their peers
        kind, status = (exc.reason, exc.status) if isinstance(exc, BadRequest) else (
            "unavailable", 503)
        refuse_items(service, items[len(started):], kind, status, str(exc))
        if isinstance(exc, BadRequest):
            raise Refusal.of(exc) from exc
        raise Refusal("unavailable", 503, str(exc)) from exc
    return started


def spawned_by(rids: Sequence[str]) -> list[tuple[str, ...]]:
    """For each of one request's ``rids``, the rids the client's request spawned it by, which
    abort it too (:meth:`Service.abort_request`): as SGLang names a request's samples
    ``<rid>_<i>`` and a batch's items ``<rid>-<k>`` (their samples ``<rid>-<k>_<i>``), ``rid``
    for each, and ``<rid>-<k>`` for a batch item's samples. Only rids named so as a whole (every
    index from 0, each prompt's samples as many) have any; none for a lone rid."""
    none: list[tuple[str, ...]] = [()] * len(rids)
    samples = _named(rids, "_")
    if samples is None:
        batch = _named(rids, "-")
        return none if batch is None or len(batch) != 1 else [(batch[0],)] * len(rids)
    if len(samples) == 1:
        return [(samples[0],)] * len(rids)
    per_prompt = len(rids) // len(samples)
    batch = _named(samples, "-")
    whole = (batch[0],) if batch is not None and len(batch) == 1 else ()
    return [(*whole, samples[k // per_prompt]) for k in range(len(rids))]


def _named(rids: Sequence[str], mark: str) -> list[str] | None:
    """The bases of ``rids`` when they are exactly ``<base><mark><i>`` for each base in turn
    and ``i`` from 0, as many of each; else None."""
    parts = [rid.rpartition(mark) for rid in rids]
    if not parts or any(not sep or not index.isdecimal() for _, sep, index in parts):
        return None
    bases = list(dict.fromkeys(base for base, _, _ in parts))
    each = len(rids) // len(bases)
    named = [f"{base}{mark}{i}" for base in bases for i in range(each)]
    return bases if named == list(rids) else None


class _ClientGone(Exception):
    """The client went away while its request waited."""


async def _look_up(service: Service, request: Request, items: list[Item],
                   looked_up: list[Item]) -> None:
    """Wait until the prefill servers ``looked_up`` name are connected; :class:`Refusal`, told
    to the peers of ``items``, when one cannot be, when they do not fit the queue, when the
    server drains or when the client goes away first."""
    gone = asyncio.ensure_future(_until_disconnect(request))
    waiting_for = looked_up[0]
    try:
        with service.looking_up(looked_up):
            for waiting_for in {i.bootstrap_addr: i for i in looked_up}.values():
                await _connect(service, waiting_for, gone)
    except PeerUnreachable as exc:
        logger.info("refused %s (500 bootstrap_failed): %s", shown_rids(items), exc)
        refuse_items(service, items, "bootstrap_failed", 500, str(exc))
        # The rid of the first request that names the unreachable prefill.
        raise Refusal("bootstrap_failed", 500, str(exc), waiting_for.rid) from exc
    except BadRequest as exc:  # overloaded: no room for them to wait
        refuse_items(service, items, exc.reason, exc.status, str(exc))
        raise Refusal.of(exc) from exc
    except Unavailable as exc:  # draining began during the look-up
        refuse_items(service, items, "draining", 503, str(exc))
        raise Refusal("draining", 503, str(exc), waiting_for.rid) from exc
    except _ClientGone as exc:
        logger.info("client went away during its prefill's look-up; aborted %s",
                    [i.rid for i in items])
        why = "the client went away while its prefill server was looked up"
        refuse_items(service, items, "aborted", 499, why)
        raise Refusal("aborted", 499, why, waiting_for.rid) from exc
    finally:
        gone.cancel()


#: How often a request waiting for its prefill server's look-up checks for a drain.
_CONNECT_POLL_S = 0.25
#: How long a request waits for its prefill server's manager beyond ``--connect-timeout`` (the
#: look-up's own bound): building it once the prefill answered (a transfer engine, sockets).
_SET_UP_S = 10.0


async def _connect(service: Service, item: Item, gone: asyncio.Future[None]) -> None:
    """Wait for ``item``'s prefill server to be connected: the look-up of its address, shared
    with every request naming it, runs on a thread of its own and ends by ``--connect-timeout``
    (a request holds no thread while it waits). :class:`PeerUnreachable` when it fails, or
    when it is not done ``_SET_UP_S`` after that; :class:`Unavailable` once the server drains
    (a drain counts a request only once it has started: the exit would have waited for this
    handler); :class:`_ClientGone` once ``gone`` is done. A request that stops waiting
    withdraws; the look-up goes on for the others, to its end by ``--connect-timeout`` (or
    sooner, between tries, when the decode router closes)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: PeerUnreachable | None) -> None:
        if not done.done():
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

    def told(error: PeerUnreachable | None) -> None:  # on the look-up's thread
        with contextlib.suppress(RuntimeError):  # the event loop closed: nobody waits
            loop.call_soon_threadsafe(settle, error)

    withdraw = service.connect_peer_soon(item, told)
    if withdraw is None:
        lost = service.peer_lost(item)
        if lost is not None:
            raise PeerUnreachable(item.bootstrap_addr, lost)
        return
    limit_s = service.config.mooncake.connect_timeout_s + _SET_UP_S
    deadline = loop.time() + limit_s
    try:
        while not done.done():
            await asyncio.wait({done, gone}, timeout=_CONNECT_POLL_S,
                               return_when=asyncio.FIRST_COMPLETED)
            if done.done():
                break
            if gone.done():
                raise _ClientGone
            if service.draining:
                raise Unavailable("the server is draining (shutting down)")
            if loop.time() >= deadline:
                raise PeerUnreachable(item.bootstrap_addr, f"not connected after {limit_s:g} s "
                                      f"(--connect-timeout and {_SET_UP_S:g} s to set up)")
    finally:
        if not done.done():
            withdraw()
            done.cancel()
    done.result()


def trace_carrier(service: Service, request: Request) -> dict[str, str] | None:
    """The caller's W3C trace headers, when the service traces requests."""
    if service.tracer is None:
        return None
    return {k: request.headers[k] for k in ("traceparent", "tracestate") if k in request.headers}


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def wait(service: Service, request: Request, pending: list[Pending]) -> list[Answer] | None:
    """Every answer of ``pending``, or None (and an abort of them all) if the client goes away
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
                logger.info("client went away; aborted %s", shown_rids(p.item for p in pending))
                return None
    finally:
        gone.cancel()
    return [f.result() for f in futures]


async def answered(service: Service, request: Request, pending: list[Pending],
                   failed: Callable[[Answer], Response]) -> list[Answer] | Response:
    """Every answer of ``pending`` when all succeeded; else the response to send: 499 when
    the client went away first (see :func:`wait`), or ``failed`` of the first failed answer."""
    answers = await wait(service, request, pending)
    if answers is None:
        return Response(status_code=499)
    for answer in answers:
        if answer.status != 200:
            return failed(answer)
    return answers


async def new_tokens(pending: Pending) -> AsyncIterator[Progress]:
    """The tokens decode produces for a streamed request (with their logprobs when asked), a
    pass's worth at a time, until its answer is in ``pending.future`` (tokens of the last pass
    may come only with the answer)."""
    progress = pending.progress
    assert progress is not None, "new_tokens needs a request started with stream=True"
    while not pending.future.done():
        more = asyncio.ensure_future(progress.get())
        try:
            either: set[asyncio.Future[Any]] = {more, pending.future}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the stream is closed while waiting (the client went away)
            if not more.done():
                more.cancel()
        if more.done():  # else cancelled above: the answer came first
            yield more.result()


@attrs.frozen
class Encoded:
    """A chunk already written as JSON (a stream that builds its chunks' JSON from parts it
    keeps, rather than dumping the whole chunk again)."""

    json: str


def sse(data: Any) -> bytes:
    """One server-sent event: ``data: <JSON>`` (``data`` dumped, or an :class:`Encoded`'s
    JSON as it is)."""
    text = data.json if isinstance(data, Encoded) else json.dumps(data)
    return f"data: {text}\n\n".encode()


async def events(service: Service, pending: list[Pending],
                 chunks: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """``chunks`` as server-sent events, then ``data: [DONE]``; a stream closed before that (the
    client went away) aborts the requests of ``pending``."""
    finished = False
    try:
        async for chunk in chunks:
            yield sse(chunk)
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:
            for p in pending:
                service.abort(p.item.rid)
            logger.info("stream of %s closed early; aborted",
                        shown_rids(p.item for p in pending))


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of ``streams`` (the samples of one request) as each comes, until all end."""
    ahead: dict[asyncio.Future[T], AsyncIterator[T]] = {
        asyncio.ensure_future(anext(s)): s for s in streams}
    try:
        while ahead:
            done, _ = await asyncio.wait(ahead, return_when=asyncio.FIRST_COMPLETED)
            for f in done:
                stream = ahead.pop(f)
                try:
                    item = f.result()
                except StopAsyncIteration:
                    continue
                yield item
                ahead[asyncio.ensure_future(anext(stream))] = stream
    finally:
        for f in ahead:
            f.cancel()
