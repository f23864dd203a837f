"""Prometheus metrics of the HTTP service (names prefixed ``pdlife_``).

They live in the registry of the service's engines (the prefill scheduler's, else the decode
peer's, whose own series are :class:`~scheduler.decode.metrics.DecodeMetrics`), so ``/metrics``
is one registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kv.wire import DroppedMessages

if TYPE_CHECKING:
    from scheduler.sample.grammar import CompileStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "pdlife_http_requests", "HTTP requests answered, by route, method and status.",
            ["route", "method", "status"], registry=r,
        )
        self.http_seconds = Histogram(
            "pdlife_http_request_seconds", "Time to answer an HTTP request (to the first byte "
            "of a stream), by route.", ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.http_rejected = Counter(
            "pdlife_http_rejected", "Requests refused by the HTTP service before reaching a "
            "scheduler, by reason.", ["reason"], registry=r,
        )
        # The refusals every worker can meet, at 0 before the first: an alert on their rate
        # reads 0, not "no data" (other reasons appear as they occur).
        for reason in ("invalid_request", "overloaded", "draining", "unhealthy", "starting",
                       "unauthorized", "body_too_large", "bootstrap_failed"):
            self.http_rejected.labels(reason=reason)
        self.healthy = Gauge(
            "pdlife_service_healthy", "1 while the engine loop runs, 0 once it failed.", registry=r
        )
        self.draining = Gauge(
            "pdlife_service_draining", "1 once the service stopped admitting requests.",
            registry=r,
        )
        self.healthy.set(1)
        # process_open_fds and process_max_fds among them: a transfer engine keeps sockets to
        # every decode peer it wrote to (scheduler.cli.open_files). A registry that has them
        # already (prometheus_client's global one) keeps its own.
        if r.get_sample_value("process_open_fds") is None:
            ProcessCollector(registry=r)


#: The drop reasons every side exports, at 0 before the first (the others appear when counted).
ALWAYS_DROP_REASONS = ("malformed", "unauthenticated", "stale_room", "state_out_of_range",
                       "incompatible_layout", "incompatible_model", "unknown_type")


class DroppedMessagesCollector(Collector):
    """``pdlife_control_messages_dropped_total{side,reason}``: control messages the transfer
    backends validated and dropped (malformed, unauthenticated, out of range, stale), read from
    their counters at scrape time."""

    def __init__(self, sources: Callable[[], Iterable[tuple[str, DroppedMessages]]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "pdlife_control_messages_dropped",
            "Control messages dropped by a transfer backend, by side and reason.",
            labels=["side", "reason"],
        )
        totals: dict[tuple[str, str], int] = {}
        for side, dropped in self._sources():
            for reason in ALWAYS_DROP_REASONS:  # 0 before the first, for rates and alerts
                totals.setdefault((side, reason), 0)
            for reason, n in dropped.snapshot().items():
                totals[(side, reason)] = totals.get((side, reason), 0) + n
        for (side, reason), n in sorted(totals.items()):
            family.add_metric([side, reason], n)
        yield family


class PeerAuthCollector(Collector):
    """``pdlife_peer_auth_failures_total{side}``: peers refused for a missing or wrong peer token,
    read at scrape time. ``prefill``: requests this prefill's bootstrap endpoint answered 401;
    ``decode``: prefill servers that refused this decode's token (or disagreed on whether peers
    authenticate) when it tried to register."""

    def __init__(self, sources: Callable[[], Mapping[str, int]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "pdlife_peer_auth_failures",
            "Peers refused for a missing or wrong peer token, by side.", labels=["side"],
        )
        for side, n in sorted(self._sources().items()):
            family.add_metric([side], n)
        yield family


class GrammarCompilesCollector(Collector):
    """``pdlife_grammar_compiles_total{result}``: the grammars the server's compiler compiled,
    read at scrape time: ``prepared`` (at admission, for the engines to take), ``inline`` (on
    an engine's thread, which stalls every live request's pass meanwhile: nothing prepared
    waited), ``refused`` (it did not compile)."""

    def __init__(self, stats: Callable[[], CompileStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self._stats()
        family = CounterMetricFamily(
            "pdlife_grammar_compiles", "Grammars the server compiled, by where and whether "
            "they compiled.", labels=["result"],
        )
        for result in ("prepared", "inline", "refused"):
            family.add_metric([result], getattr(stats, result))
        yield family
