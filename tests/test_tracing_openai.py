"""A W3C ``traceparent`` on the OpenAI endpoints makes the request's spans children of the
caller's trace, as on ``/generate``: a completion plain and streamed on a colocated worker, and
a chat completion as SGLang's router sends it to a decode worker (its bootstrap fields in the
body, the fake bootstrap host standing in for the prefill peer). Spans come from the SDK's
in-memory exporter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.core import ServeConfig
from scheduler.service.tracing import LifecycleTracer
from tests.service_harness import asgi_client, run, running_service, wait_for

MODEL = ModelConfig.tiny(seed=5)
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
OTHER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def config(role: str, backend: str, **kw: Any) -> ServeConfig:
    return ServeConfig(role=role, backend=backend, model=MODEL,  # type: ignore[arg-type]
                       scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=16),
                       pool_pages=64, metadata_slots=8, max_new_tokens_limit=8, **kw)


def in_memory(backend: str) -> tuple[LifecycleTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return LifecycleTracer(provider, backend=backend), exporter


def roots(exporter: InMemorySpanExporter, name: str) -> dict[str, ReadableSpan]:
    """The spans called ``name``, by request id."""
    return {str(s.attributes["pdlife.rid"]): s for s in exporter.get_finished_spans()
            if s.name == name and s.attributes is not None}


def children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    kids = [s for s in spans if s.parent is not None
            and s.parent.span_id == parent.context.span_id]
    return sorted(kids, key=lambda s: s.start_time or 0)


def test_completions_plain_and_streamed_join_the_callers_trace() -> None:
    tracer, exporter = in_memory("local")
    body = {"prompt": "traced", "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def main() -> None:
        with running_service(config("both", "local"), tracer=tracer) as service:
            async with asgi_client(service) as client:
                for rid, extra in (("plain", {}), ("streamed", {"stream": True})):
                    r = await client.post("/v1/completions", headers={"traceparent": TRACEPARENT},
                                          json={**body, **extra, "rid": rid})
                    assert r.status_code == 200, r.text
                r = await client.post("/v1/completions", json={**body, "rid": "untraced"})
                assert r.status_code == 200, r.text

    run(main())
    wait_for(lambda: len(roots(exporter, "pdlife.request")) == 3, 10, "three request spans")
    spans = exporter.get_finished_spans()
    requests = roots(exporter, "pdlife.request")
    for rid in ("plain", "streamed"):
        root = requests[rid]
        assert root.context.trace_id == int(TRACE_ID, 16), rid
        assert root.parent is not None and root.parent.span_id == int(PARENT_ID, 16)
        assert root.status.status_code is StatusCode.UNSET
        sides = children(spans, root)
        assert [s.name for s in sides] == ["pdlife.prefill", "pdlife.decode"]
        assert all(s.context.trace_id == int(TRACE_ID, 16) for s in sides)
        assert sides[1].attributes is not None
        assert sides[1].attributes["pdlife.output_tokens"] == 4
        assert [k.name for k in children(spans, sides[1])] == [
            "bootstrap_wait", "prealloc_wait", "kv_receive", "decode"]
    # Without a traceparent a request starts a trace of its own.
    untraced = requests["untraced"]
    assert untraced.parent is None and untraced.context.trace_id != int(TRACE_ID, 16)


def test_a_chat_body_as_the_router_sends_it_joins_the_callers_trace_on_a_decode_worker(
        smollm2: Any) -> None:
    tracer, exporter = in_memory("fake")
    served = config("decode", "fake", served=smollm2, model_name="smollm2")
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "temperature": 0, "bootstrap_host": "2.2.2.2",
            "bootstrap_port": 8998, "bootstrap_room": 77, "rid": "chat"}
    traceparent = f"00-{OTHER_TRACE}-{PARENT_ID}-01"

    async def main() -> None:
        with running_service(served, tracer=tracer) as service:
            async with asgi_client(service) as client:
                r = await client.post("/v1/chat/completions", json=body,
                                      headers={"traceparent": traceparent,
                                               "tracestate": "vendor=1"})
                assert r.status_code == 200, r.text

    run(main())
    wait_for(lambda: "chat" in roots(exporter, "pdlife.decode"), 10, "the decode span")
    root = roots(exporter, "pdlife.decode")["chat"]
    assert root.context.trace_id == int(OTHER_TRACE, 16)
    assert root.parent is not None and root.parent.span_id == int(PARENT_ID, 16)
    assert root.context.trace_state.get("vendor") == "1"
    assert root.attributes is not None and root.attributes["pdlife.backend"] == "fake"
    assert [k.name for k in children(exporter.get_finished_spans(), root)][-1] == "decode"
