"""OpenTelemetry spans of finished requests, built from their lifecycle timelines
(``pdlife serve --enable-trace``).

Theory of operation
-------------------
Nothing here runs in a scheduler pass. Every answer (:class:`~scheduler.messages.Response`,
:class:`~scheduler.messages.DecodeResponse`) carries its request's ``(monotonic time, event)``
timeline; when every engine a request went to has answered, the service hands the answers to
:meth:`LifecycleTracer.finished`, which replays each timeline through its table
(:func:`lifecycle.timeline.records`, the one source of truth that also feeds Perfetto traces and
the TTFT-phase histograms) and builds the spans after the fact, with explicit start and end
times::

    pdlife.prefill            rid, bootstrap room, prompt/cached tokens, backend, outcome
    ├── bootstrap_wait        BOOTSTRAPPING             event: bootstrapped
    ├── queue_wait            WAITING                   event: schedule
    ├── forward               FORWARD, chunk_index 0    event: chunk_done
    ├── forward               FORWARD, chunk_index 1    event: prefilled
    └── transfer              TRANSFERRING              event: transferred

One child span per stay in a state; a state with a self-loop in its table (the prefill
``FORWARD`` and its ``chunk_done``) has one span per segment, numbered by ``pdlife.chunk_index``.
The decode side's root is ``pdlife.decode`` (``bootstrap_wait``, ``prealloc_wait``,
``kv_receive``, ``decode``). With the local backend one process runs both sides: a
``pdlife.request`` span holds both. Every transition is an event on the span of the stay it
ended; the scheduler fires a batch of requests at one clock reading, so ``pdlife.batch_id`` (the
table, the event and that time) is the same on every request moved by one batched firing, which
is how a tracing backend groups a batch. A request that failed has its reason on the root
(``pdlife.failure_reason``) and error status on the root and on the span it failed in.

A W3C ``traceparent`` (and ``tracestate``) the client sent makes the root a child of the
caller's span, so a router's trace and both workers' spans join up. The root is the request's
span in this worker (kind SERVER, as a backend draws a service's entry point); the stays, and
a local pair's two sides under ``pdlife.request``, are INTERNAL. The instrumentation scope is
``pdlife`` at the installed version, which the resource also carries (``service.version``).

Monotonic timeline times are placed on the wall clock by one reading of both clocks per request.
The SDK's batch processor exports from its own thread; a request whose spans cannot be built is
logged and skipped, never failed. This module imports the OpenTelemetry SDK: the service
imports it only when tracing is on (the ``trace`` extra).
"""

from __future__ import annotations

import enum
import importlib.metadata
import logging
import time
import urllib.parse
from collections.abc import Mapping, Sequence

import attrs
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from lifecycle import DECODE_TABLE, PREFILL_TABLE
from lifecycle.timeline import records
from scheduler.messages import DecodeResponse, Response
from scheduler.service.pending import Pending

logger = logging.getLogger(__name__)

Answer = Response | DecodeResponse

# Span names of the stays in each state; the prefill ones are the TTFT phases' names
# (``pdlife_ttft_phase_seconds{phase}``).
_STAY_NAMES: dict[str, dict[str, str]] = {
    PREFILL_TABLE.name: {"BOOTSTRAPPING": "bootstrap_wait", "WAITING": "queue_wait",
                         "FORWARD": "forward", "TRANSFERRING": "transfer"},
    DECODE_TABLE.name: {"BOOTSTRAPPING": "bootstrap_wait", "PREALLOC": "prealloc_wait",
                        "RECEIVING": "kv_receive", "DECODING": "decode"},
}


def otlp_endpoint_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: ``HOST:PORT`` (SGLang's form) becomes
    ``http://HOST:PORT/v1/traces``; a URL (``http`` or ``https``) is taken as it is. Raises
    ``ValueError`` for anything else (a port beyond 65535, no port), which the exporter
    would only refuse at its first export."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}/v1/traces"
    parts = urllib.parse.urlsplit(url)
    wrong = ValueError(f"{endpoint!r} is not HOST:PORT (the port 1..65535) nor an http(s) URL")
    try:
        port = parts.port  # raises for a port beyond 0..65535 or not a number
    except ValueError:
        raise wrong from None
    if parts.scheme not in ("http", "https") or not parts.hostname or (
            "://" not in endpoint and not port):
        raise wrong
    return url


@attrs.frozen
class _Clock:
    """Monotonic seconds to wall-clock nanoseconds, from one reading of both clocks."""

    offset_ns: int

    @classmethod
    def now(cls) -> _Clock:
        return cls(time.time_ns() - time.monotonic_ns())

    def ns(self, monotonic: float) -> int:
        return round(monotonic * 1e9) + self.offset_ns


@attrs.frozen
class Request:
    """What the service knows of a request beyond its answers."""

    bootstrap_room: int
    backend: str  # the transfer backend that served it ("fake" for the fake bootstrap host)
    carrier: Mapping[str, str] | None = None  # the caller's trace headers


class LifecycleTracer:
    """Builds each finished request's spans from its answers' timelines; ``backend`` is the
    service's transfer backend."""

    def __init__(self, provider: TracerProvider, *, backend: str) -> None:
        self.provider = provider
        self.backend = backend
        self._tracer = provider.get_tracer("pdlife", pdlife_version())
        self._propagator = TraceContextTextMapPropagator()

    def close(self) -> None:
        """Export what is buffered and stop the exporter (the exporter retries a collector
        that does not answer for several seconds: this says why shutdown waits)."""
        logger.info("tracing: sending the spans still buffered before exit (several seconds "
                    "if the collector does not answer)")
        self.provider.shutdown()

    def finished(self, pending: Pending) -> None:
        """The spans of a request every engine has answered (the service's hook)."""
        item = pending.item
        self.emit(pending.answers, Request(
            bootstrap_room=item.bootstrap_room, backend="fake" if item.fake else self.backend,
            carrier=pending.carrier))

    def emit(self, answers: Sequence[Answer], request: Request) -> None:
        """The spans of one request, whose engines gave ``answers`` (prefill's first)."""
        if not answers:
            return
        try:
            self._emit(answers, request)
        except Exception:
            logger.exception("the spans of request %r were not built", answers[0].rid)

    def _emit(self, answers: Sequence[Answer], request: Request) -> None:
        clock = _Clock.now()
        parent = self._propagator.extract(request.carrier) if request.carrier else None
        if len(answers) == 1:
            self._side(answers[0], request, parent, clock, SpanKind.SERVER)
            return
        now = time.monotonic()
        start = min((a.timeline[0][0] for a in answers if a.timeline), default=now)
        end = max((a.timeline[-1][0] for a in answers if a.timeline), default=now)
        root = self._tracer.start_span(
            "pdlife.request", context=parent, start_time=clock.ns(start),
            attributes={"pdlife.rid": answers[0].rid, **_request_attributes(request)},
            kind=SpanKind.SERVER,
        )
        failed = next((a for a in reversed(answers) if a.reason is not None), None)
        if failed is not None:
            _fail(root, failed)
        inside = trace.set_span_in_context(root)
        for answer in answers:
            self._side(answer, request, inside, clock)
        root.end(end_time=clock.ns(end))

    def _side(self, answer: Answer, request: Request, parent: Context | None,
              clock: _Clock, kind: SpanKind = SpanKind.INTERNAL) -> None:
        """One side's root span (``kind`` SERVER when it is the request's span in this
        worker) and a child span per stay in a state."""
        table = PREFILL_TABLE if isinstance(answer, Response) else DECODE_TABLE
        names = _STAY_NAMES[table.name]
        looping = {e.source for e in table.edges if e.source is e.dest}
        now = time.monotonic()
        start = answer.timeline[0][0] if answer.timeline else now
        transitions = records(answer, table)
        end = transitions[-1].time if transitions else start
        root = self._tracer.start_span(
            f"pdlife.{table.name}", context=parent, start_time=clock.ns(start),
            attributes=_answer_attributes(answer, request), kind=kind,
        )
        if answer.reason is not None:
            _fail(root, answer)
        inside = trace.set_span_in_context(root)
        state: enum.IntEnum = table.initial
        entered, chunk = start, 0
        for rec in transitions:
            attributes: dict[str, AttributeValue] = {"pdlife.state": state.name}
            if state in looping:
                attributes["pdlife.chunk_index"] = chunk
            stay = self._tracer.start_span(
                names.get(state.name, state.name.lower()), context=inside,
                start_time=clock.ns(entered), attributes=attributes,
            )
            event: dict[str, AttributeValue] = {
                "pdlife.batch_id": f"{table.name}:{rec.event}:{round(rec.time * 1e9)}"}
            if rec.reason is not None:
                event["pdlife.failure_reason"] = str(rec.reason.value)
                stay.set_status(Status(StatusCode.ERROR, str(rec.reason.value)))
            stay.add_event(rec.event, attributes=event, timestamp=clock.ns(rec.time))
            stay.end(end_time=clock.ns(rec.time))
            chunk = chunk + 1 if rec.dest is state else 0
            state, entered = rec.dest, rec.time
        root.end(end_time=clock.ns(end))


def pdlife_version() -> str:
    """The installed pdlife's version (the spans' instrumentation scope and resource)."""
    try:
        return importlib.metadata.version("pdlife")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout not installed
        return "unknown"


def _request_attributes(request: Request) -> dict[str, AttributeValue]:
    # A room is a uint64; OTLP integers are int64, so a room that does not fit is a string.
    room = request.bootstrap_room
    return {"pdlife.bootstrap_room": room if room < 1 << 63 else str(room),
            "pdlife.backend": request.backend}


def _answer_attributes(answer: Answer, request: Request) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "pdlife.rid": answer.rid,
        **_request_attributes(request),
        "pdlife.prompt_tokens": answer.prompt_tokens,
        "pdlife.cached_tokens": answer.cached_tokens,
        "pdlife.final_state": answer.state.name,
    }
    if isinstance(answer, DecodeResponse):
        attributes["pdlife.output_tokens"] = len(answer.output_ids)
        attributes["pdlife.finish_reason"] = answer.finish_reason
    if answer.reason is not None:
        attributes["pdlife.failure_reason"] = str(answer.reason.value)
        attributes["pdlife.failure_detail"] = answer.detail
    return attributes


def _fail(span: trace.Span, answer: Answer) -> None:
    assert answer.reason is not None
    span.set_status(Status(StatusCode.ERROR, f"{answer.reason.value}: {answer.detail}"))


def otlp_tracer(endpoint: str, *, role: str, backend: str) -> LifecycleTracer:
    """A tracer that exports over OTLP/HTTP (protobuf) to ``endpoint`` (``HOST:PORT`` or a URL)
    in batches, from the SDK's export thread; the service is named ``pdlife-<role>``."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    name = "pdlife" if role == "both" else f"pdlife-{role}"
    provider = TracerProvider(resource=Resource.create(
        {"service.name": name, "service.version": pdlife_version()}))
    url = otlp_endpoint_url(endpoint)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    logger.info("tracing: spans of finished requests go to %s (OTLP/HTTP) as %s", url, name)
    return LifecycleTracer(provider, backend=backend)
