"""OpenTelemetry spans from request timelines: the span tree of a chunked prefill request under
the caller's trace, both sides of the local backend under one request span, failure reasons
from every live state, and one real ``pdlife serve --enable-trace`` exporting OTLP/HTTP
protobuf to a receiver in the test."""

from __future__ import annotations

import http.server
import importlib.metadata
import itertools
import re
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from lifecycle import FailureReason, PrefillState
from lifecycle.record import ADMITTED
from scheduler.messages import Response
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.core import ServeConfig
from scheduler.service.tracing import (
    LifecycleTracer,
    Request,
    otlp_endpoint_url,
    pdlife_version,
)
from tests.service_harness import Server, asgi_client, run, running_service, wait_for

MODEL = ModelConfig.tiny(seed=5)
SCHED = SchedulerConfig(page_size=4, chunked_prefill_size=16, radix_cache=True)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def config(role: str, backend: str) -> ServeConfig:
    return ServeConfig(role=role, backend=backend, model=MODEL, scheduler=SCHED,  # type: ignore[arg-type]
                       pool_pages=64, metadata_slots=8, max_new_tokens_limit=8)


def in_memory(backend: str) -> tuple[LifecycleTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return LifecycleTracer(provider, backend=backend), exporter


def roots_named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    """The SDK spans whose parent is ``parent``, in start order."""
    kids = [s for s in spans if s.parent is not None
            and s.parent.span_id == parent.context.span_id]
    return sorted(kids, key=lambda s: s.start_time or 0)


# -- in process, the SDK's in-memory exporter -----------------------------------------------


def test_prefill_span_tree_has_a_span_per_state_and_chunk_under_the_callers_trace() -> None:
    tracer, exporter = in_memory("fake")
    prompt = list(range(1, 41))  # 40 tokens in chunks of 16: three forward spans

    async def main() -> None:
        with running_service(config("prefill", "fake"), tracer=tracer) as service:
            async with asgi_client(service) as client:
                for rid in ("first", "again"):  # the second finds the prompt cached
                    r = await client.post(
                        "/generate", headers={"traceparent": TRACEPARENT},
                        json={"input_ids": prompt, "rid": rid,
                              "sampling_params": {"max_new_tokens": 1}})
                    assert r.status_code == 200, r.text

    run(main())
    wait_for(lambda: len(roots_named(exporter, "pdlife.prefill")) == 2, 10, "two root spans")
    spans = exporter.get_finished_spans()
    roots = {s.attributes["pdlife.rid"]: s for s in roots_named(exporter, "pdlife.prefill")}
    first = roots["first"]
    assert first.context.trace_id == int(TRACE_ID, 16)
    assert first.parent is not None and first.parent.span_id == int(PARENT_ID, 16)
    attrs = first.attributes
    assert attrs["pdlife.prompt_tokens"] == 40
    assert attrs["pdlife.cached_tokens"] == 0
    assert attrs["pdlife.backend"] == "fake"
    assert attrs["pdlife.final_state"] == "DONE"
    assert isinstance(attrs["pdlife.bootstrap_room"], int)
    assert "pdlife.failure_reason" not in attrs
    kids = children(spans, first)
    assert [k.name for k in kids] == ["bootstrap_wait", "queue_wait", "forward", "forward",
                                      "forward", "transfer"]
    assert [k.attributes.get("pdlife.chunk_index") for k in kids[2:5]] == [0, 1, 2]
    assert [[e.name for e in k.events] for k in kids] == [
        ["bootstrapped"], ["schedule"], ["chunk_done"], ["chunk_done"], ["prefilled"],
        ["transferred"]]
    # The stays tile the root: each starts where the previous ended.
    assert kids[0].start_time == first.start_time and kids[-1].end_time == first.end_time
    for before, after in itertools.pairwise(kids):
        assert before.end_time == after.start_time
    assert all(k.status.status_code is StatusCode.UNSET for k in [first, *kids])
    # The request's span in this worker is its entry point; the stays are inside it.
    assert first.kind is SpanKind.SERVER and {k.kind for k in kids} == {SpanKind.INTERNAL}
    assert first.instrumentation_scope is not None
    assert (first.instrumentation_scope.name,
            first.instrumentation_scope.version) == ("pdlife", pdlife_version())
    assert pdlife_version() == importlib.metadata.version("pdlife")
    batch = kids[1].events[0].attributes
    assert batch is not None and str(batch["pdlife.batch_id"]).startswith("prefill:schedule:")
    assert roots["again"].attributes["pdlife.cached_tokens"] > 0


def test_local_backend_puts_both_sides_under_one_request_span() -> None:
    tracer, exporter = in_memory("local")

    async def main() -> None:
        with running_service(config("both", "local"), tracer=tracer) as service:
            async with asgi_client(service) as client:
                r = await client.post("/generate", json={
                    "input_ids": [5, 6, 7], "rid": "both",
                    "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
                assert r.status_code == 200, r.text

    run(main())
    wait_for(lambda: bool(roots_named(exporter, "pdlife.request")), 10, "the request span")
    spans = exporter.get_finished_spans()
    (root,) = roots_named(exporter, "pdlife.request")
    assert root.parent is None
    sides = children(spans, root)
    assert [s.name for s in sides] == ["pdlife.prefill", "pdlife.decode"]
    assert root.kind is SpanKind.SERVER
    assert {s.kind for s in spans if s is not root} == {SpanKind.INTERNAL}
    assert sides[1].attributes["pdlife.output_tokens"] == 3
    assert [k.name for k in children(spans, sides[1])] == [
        "bootstrap_wait", "prealloc_wait", "kv_receive", "decode"]
    assert [k.name for k in children(spans, sides[0])][-1] == "transfer"


# Event prefixes that leave a prefill request in each live state.
_TO_STATE = {
    PrefillState.BOOTSTRAPPING: (),
    PrefillState.WAITING: ("bootstrapped",),
    PrefillState.FORWARD: ("bootstrapped", "schedule", "chunk_done"),
    PrefillState.TRANSFERRING: ("bootstrapped", "schedule", "prefilled"),
}
_STAY = {PrefillState.BOOTSTRAPPING: "bootstrap_wait", PrefillState.WAITING: "queue_wait",
         PrefillState.FORWARD: "forward", PrefillState.TRANSFERRING: "transfer"}


@pytest.mark.parametrize("state", list(_TO_STATE), ids=lambda s: s.name)
def test_a_failure_in_any_state_names_its_reason_on_the_root_and_the_failed_stay(
    state: PrefillState,
) -> None:
    tracer, exporter = in_memory("mooncake")
    reasons = [r for r in FailureReason if r is not FailureReason.ABORTED]
    for n, reason in enumerate([*reasons, FailureReason.ABORTED]):
        events = (*_TO_STATE[state], "abort" if reason is FailureReason.ABORTED else "fail")
        timeline = ((100.0, ADMITTED), *((100.0 + i + 1, e) for i, e in enumerate(events)))
        tracer.emit([Response(
            rid=f"r{n}", state=PrefillState.FAILED, reason=reason, detail=f"why {n}",
            first_token=None, prompt_tokens=8, timeline=timeline,
        )], Request(bootstrap_room=(1 << 64) - 1, backend="mooncake"))
        (root,) = [s for s in roots_named(exporter, "pdlife.prefill")
                   if s.attributes["pdlife.rid"] == f"r{n}"]
        assert root.attributes["pdlife.failure_reason"] == reason.value
        assert root.attributes["pdlife.failure_detail"] == f"why {n}"
        assert root.attributes["pdlife.final_state"] == "FAILED"
        assert root.attributes["pdlife.bootstrap_room"] == str((1 << 64) - 1)  # beyond int64
        assert root.status.status_code is StatusCode.ERROR
        assert reason.value in str(root.status.description)
        kids = children(exporter.get_finished_spans(), root)
        assert len(kids) == len(events)
        failed = kids[-1]
        assert failed.name == _STAY[state]
        assert failed.status.status_code is StatusCode.ERROR
        assert [e.name for e in failed.events] == [events[-1]]
        event_attrs = failed.events[0].attributes
        assert event_attrs is not None and event_attrs["pdlife.failure_reason"] == reason.value
        assert all(k.status.status_code is StatusCode.UNSET for k in kids[:-1])


def test_otlp_endpoint_url() -> None:
    assert otlp_endpoint_url("collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_endpoint_url("https://x/otlp/v1/traces") == "https://x/otlp/v1/traces"
    assert otlp_endpoint_url("[::1]:4318") == "http://[::1]:4318/v1/traces"
    # What the exporter refused only at its first export, the server running without spans.
    for wrong in ("127.0.0.1:99999", "collector", "not_a_host_port", "ftp://x:1",
                  "http://x:99999/v1/traces"):
        with pytest.raises(ValueError, match="is not HOST:PORT"):
            otlp_endpoint_url(wrong)


@pytest.mark.parametrize(("flags", "says"), [
    (("--otlp-traces-endpoint", "127.0.0.1:4318"),
     "--otlp-traces-endpoint goes with --enable-trace"),
    (("--enable-trace", "--otlp-traces-endpoint", "127.0.0.1:99999"),
     "--otlp-traces-endpoint: '127.0.0.1:99999' is not HOST:PORT"),
])
def test_serve_refuses_a_collector_it_cannot_send_to(flags: tuple[str, ...], says: str) -> None:
    import argparse

    from scheduler.cli.command import UsageError
    from scheduler.cli.serve import SERVE, serve_config

    parser = argparse.ArgumentParser()
    SERVE.add_arguments(parser)
    with pytest.raises(UsageError, match=f"^{re.escape(says)}"):
        serve_config(parser.parse_args(["--backend", "local", *flags]))
    config = serve_config(parser.parse_args(["--backend", "local", "--enable-trace",
                                             "--log-level", "DEBUG"]))
    assert config.otlp_traces_endpoint == "localhost:4318"


# -- a real server exporting OTLP/HTTP ------------------------------------------------------


class _Receiver(http.server.ThreadingHTTPServer):
    """A minimal OTLP/HTTP traces receiver: decodes each protobuf export."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ReceiverHandler)
        self.exports: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.paths: list[str] = []


class _ReceiverHandler(http.server.BaseHTTPRequestHandler):
    server: _Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = trace_service_pb2.ExportTraceServiceRequest()
        export.ParseFromString(body)
        self.server.paths.append(self.path)
        self.server.exports.append(export)
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    server = _Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.multiprocess
def test_serve_exports_otlp_http_protobuf_to_a_collector(tmp_path: Path,
                                                         receiver: _Receiver) -> None:
    host, port = receiver.server_address[:2]
    server = Server(
        tmp_path / "serve.log", "--backend", "fake", "--role", "prefill", "--hidden",
        str(MODEL.hidden), "--heads", str(MODEL.heads), "--kv-heads", str(MODEL.kv_heads),
        "--head-dim", str(MODEL.head_dim), "--intermediate", str(MODEL.intermediate),
        "--page-size", "4", "--chunked-prefill-size", "8", "--enable-trace",
        "--otlp-traces-endpoint", f"{host}:{port}", "--log-level", "warning",
    )
    try:
        server.wait_healthy()
        r = httpx.post(f"{server.url}/generate", headers={"traceparent": TRACEPARENT},
                       timeout=30, json={"input_ids": list(range(1, 20)), "rid": "otlp",
                                         "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text
        # The drain closes the exporter, which sends what it holds.
        assert server.stop() == 0, server.tail()
    finally:
        server.stop()
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    resources = [rs for e in receiver.exports for rs in e.resource_spans]
    names = {a.value.string_value for rs in resources for a in rs.resource.attributes
             if a.key == "service.name"}
    assert names == {"pdlife-prefill"}
    versions = {a.value.string_value for rs in resources for a in rs.resource.attributes
                if a.key == "service.version"}
    assert versions == {pdlife_version()}
    assert {(ss.scope.name, ss.scope.version) for rs in resources
            for ss in rs.scope_spans} == {("pdlife", pdlife_version())}
    spans = [s for rs in resources for ss in rs.scope_spans for s in ss.spans]
    mine = [s for s in spans if s.trace_id.hex() == TRACE_ID]
    (root,) = [s for s in mine if s.name == "pdlife.prefill"]
    assert root.parent_span_id.hex() == PARENT_ID
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["pdlife.rid"].string_value == "otlp"
    assert root.kind == root.SPAN_KIND_SERVER
    assert attrs["pdlife.prompt_tokens"].int_value == 19
    kids = sorted((s for s in mine if s.parent_span_id == root.span_id),
                  key=lambda s: s.start_time_unix_nano)
    assert [k.name for k in kids] == [
        "bootstrap_wait", "queue_wait", "forward", "forward", "forward", "transfer"]
