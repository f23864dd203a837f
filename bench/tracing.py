"""Tracing: what ``--enable-trace`` costs a serving loop, on and off.

The spans are built after the fact from the ``(time, event)`` timeline the lifecycle records for
every request whether tracing is on or not (it also feeds the TTFT-phase histograms and the
Perfetto traces). So tracing off adds no work to a scheduler pass, and per answer only the
service's ``tracer is not None`` tests (one per engine answer and one when the request is done);
there is no build without those tests to hold "off" against. What the benchmark shows, in one
run:

1. **the service loop, off against on**: the same workload, ``--requests`` requests of a short
   prompt and ``--new-tokens`` tokens each, ``--concurrency`` in flight, through an in-process
   ``Service`` (``--backend local``: prefill and decode in one engine loop, the tiny reference
   model), submitted as the HTTP handlers submit them; once with no tracer (off, the default),
   once with tracing on (the SDK's batch processor, as ``--enable-trace`` sets up, into an
   in-memory exporter in place of OTLP/HTTP, and a caller's ``traceparent`` on every request).
   Rounds alternate off and on; the best of each is kept. Requests per second, and their ratio
   (on timed until the exporter holds every span);
2. **what each side adds per request, measured alone**: building a finished request's spans
   (the on path, on the engine thread; replayed from the answers of the traced round), the
   off path's ``is not None`` tests, and the timeline itself (what the batched lifecycle does to
   record it: a clock read and a shared entry per batch and event, an append per request and
   event), next to the lifecycle's whole per-request cost (``bench.lifecycle``'s batched
   variant).

Last line: ``RESULT tracing on_vs_off=<on rps ÷ off rps> cpu_on_vs_off=<on CPU µs per request
÷ off's> off_rps=<..> on_rps=<..> spans_us=<µs per request, on> off_ns=<ns per request, off>
timeline_us=<µs per request> lifecycle_us=<µs per request>``; the per-request figures of part 2
are CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
import timeit
from collections.abc import Callable
from typing import Any

import attrs
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.lifecycle import BATCH, best_time, pdlife_batched
from lifecycle import SamplingParams
from lifecycle.record import ADMITTED
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.core import Pending, ServeConfig, Service
from scheduler.service.tracing import LifecycleTracer, Request

CONFIG = ServeConfig(role="both", backend="local", model=ModelConfig.tiny(),
                     scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=64),
                     pool_pages=2048, metadata_slots=64, max_new_tokens_limit=64)
PROMPT = list(range(1, 17))
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
EVENTS = ("bootstrapped", "schedule", "prefilled", "transferred")


def in_memory() -> tuple[LifecycleTracer, InMemorySpanExporter]:
    """A tracer set up as ``--enable-trace`` sets it up, exporting into memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 20))
    return LifecycleTracer(provider, backend="local"), exporter


async def _serve(service: Service, n: int, concurrency: int, new_tokens: int,
                 carrier: dict[str, str] | None, tag: str) -> list[Pending]:
    slots = asyncio.Semaphore(concurrency)
    sampling = SamplingParams(new_tokens, ignore_eos=True)

    async def one(i: int) -> Pending:
        async with slots:
            item = service.check(rid=f"{tag}-{i}", input_ids=PROMPT, sampling=sampling,
                                 bootstrap_host=None, bootstrap_port=None, bootstrap_room=None)
            pending = service.start(item, stream=False, carrier=carrier)
            answer = await pending.future
            if answer.status != 200 or len(answer.output_ids) != new_tokens:
                raise RuntimeError(f"request {answer.rid} failed: {answer.message}")
            return pending

    return await asyncio.gather(*(one(i) for i in range(n)))


def spans_of(pending: list[Pending]) -> int:
    """How many spans the tracer's requests have: a request span, two sides, their stays."""
    return sum(1 + len(p.answers) + sum(len(a.timeline) - 1 for a in p.answers)
               for p in pending)


@attrs.define
class Best:
    """The best round of a mode: requests per second (wall), CPU µs per request (process)."""

    rps: float = 0.0
    cpu_us: float = float("inf")


def rounds(args: argparse.Namespace) -> tuple[Best, Best, list[Pending]]:
    """The best rounds off and on, alternating; the traced round's requests."""
    best = {"off": Best(), "on": Best()}
    traced: list[Pending] = []
    for r in range(args.repeats + 1):  # the first round of each warms up
        for mode in ("off", "on"):
            tracer, exporter = in_memory() if mode == "on" else (None, None)
            service = Service(CONFIG, tracer=tracer)
            service.start_loop()
            try:
                gc.collect()
                wall, cpu = time.perf_counter(), time.process_time()
                done = asyncio.run(_serve(
                    service, args.requests, args.concurrency, args.new_tokens,
                    {"traceparent": TRACEPARENT} if tracer is not None else None, f"{mode}{r}"))
            finally:
                # Stopping the loop lets the last answers' spans be built; closing the tracer
                # exports what its processor holds.
                service.close()
            rps = args.requests / (time.perf_counter() - wall)
            cpu_us = (time.process_time() - cpu) / args.requests * 1e6
            if exporter is not None:
                want, got = spans_of(done), len(exporter.get_finished_spans())
                if got != want:
                    raise RuntimeError(f"the exporter holds {got} spans, not {want}")
                traced = done
            if r > 0:
                best[mode].rps = max(best[mode].rps, rps)
                best[mode].cpu_us = min(best[mode].cpu_us, cpu_us)
            print(f"  round {r} {mode:>3}: {rps:8.1f} requests/s {cpu_us:8.0f} CPU us/request"
                  f"{'  (warm-up)' if r == 0 else ''}", flush=True)
    return best["off"], best["on"], traced


def spans_us(traced: list[Pending], repeats: int) -> float:
    """CPU microseconds per request to build its spans from its answers (the engine thread's
    part of tracing on, and the batch processor's export thread as far as it runs meanwhile)."""
    best = float("inf")
    for _ in range(repeats):
        tracer, _exporter = in_memory()
        requests = [Request(bootstrap_room=p.item.bootstrap_room, backend="local",
                            carrier={"traceparent": TRACEPARENT}) for p in traced]
        gc.collect()
        start = time.process_time()
        for p, request in zip(traced, requests, strict=True):
            tracer.emit(p.answers, request)
        best = min(best, time.process_time() - start)
        tracer.close()
    return best / len(traced) * 1e6


class _Off:
    """Where the service keeps its tracer (an instance attribute), off."""

    def __init__(self) -> None:
        self.tracer: LifecycleTracer | None = None


def off_ns(repeats: int) -> float:
    """Nanoseconds per request of the off path: a request of the local backend gets two engine
    answers, each tests the service's tracer, and one more test when it is done."""
    n = 1_000_000
    test = "if service.tracer is not None: raise AssertionError\n"
    return min(timeit.repeat(test * 3, number=n, repeat=repeats, timer=time.process_time,
                             globals={"service": _Off()})) / n * 1e9


def timeline_work(n: int) -> list[Any]:
    """What the batched lifecycle does to record the timeline, alone: per request its list
    and its admission entry (a clock read each), per batch and event one clock read and one
    shared entry, appended to every request of the batch."""
    clock = time.monotonic
    out: list[Any] = []
    for start in range(0, n, BATCH):
        batch: list[list[tuple[float, str]]] = [[] for _ in range(start, min(n, start + BATCH))]
        for timeline in batch:
            timeline.append((clock(), ADMITTED))
        for event in EVENTS:
            entry = (clock(), event)
            for timeline in batch:
                timeline.append(entry)
        out.extend(batch)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400,
                        help="requests through the service per round (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=32,
                        help="requests in flight at once (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=4,
                        help="tokens each request decodes (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds after a warm-up, tracing off and on alternating; the "
                             "best counts (default: %(default)s)")
    parser.add_argument("--lifecycle-requests", type=int, default=10_000,
                        help="request lifecycles of the span-building measurement "
                             "(default: %(default)s)")
    args = parser.parse_args()

    print(f"the service loop (--backend local, tiny reference model): {args.requests} requests "
          f"of {len(PROMPT)} tokens, {args.new_tokens} new tokens each, {args.concurrency} in "
          f"flight; best of {args.repeats} rounds after a warm-up, off and on alternating")
    off, on, traced = rounds(args)
    print(f"  best: off {off.rps:8.1f} requests/s {off.cpu_us:6.0f} CPU us/request; on "
          f"{on.rps:8.1f} requests/s {on.cpu_us:6.0f} CPU us/request; on/off "
          f"{on.rps / off.rps:.3f} requests/s, {on.cpu_us / off.cpu_us:.3f} CPU")

    def measure(run: Callable[[int], list[Any]]) -> float:
        return best_time(run, args.lifecycle_requests, args.repeats, time.process_time)

    spans = spans_us(traced, args.repeats)
    tests_ns = off_ns(args.repeats)
    timeline = measure(timeline_work)
    lifecycle = measure(pdlife_batched)
    print("per request, measured alone (CPU time, best of the repeats):")
    print(f"  on:  building its spans                        {spans:9.2f} us")
    print(f"  off: the tracer tests                          {tests_ns / 1000:9.3f} us")
    print(f"  the timeline, recorded either way              {timeline:9.2f} us")
    print(f"  the whole batched prefill lifecycle            {lifecycle:9.2f} us")
    print(f"RESULT tracing on_vs_off={on.rps / off.rps:.3f} cpu_on_vs_off="
          f"{on.cpu_us / off.cpu_us:.3f} off_rps={off.rps:.1f} on_rps={on.rps:.1f} "
          f"spans_us={spans:.1f} off_ns={tests_ns:.0f} timeline_us={timeline:.2f} "
          f"lifecycle_us={lifecycle:.2f}")


if __name__ == "__main__":
    main()
