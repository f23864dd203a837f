"""Prometheus metrics of a prefill scheduler (names prefixed ``pdlife_``).

Each scheduler owns its own :class:`prometheus_client.CollectorRegistry`, so several schedulers
(tests, ranks in one process) never share series. Counters are fed from lifecycle events; the
gauges are set once per pass from counts the scheduler already keeps (no scans).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kv.transfer import REASON_PEER_REFUSED
from lifecycle import PrefillState
from lifecycle.prefill import PrefillRequest
from lifecycle.reasons import OUTCOMES
from lifecycle.timeline import ttft_phases

_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_PHASES = ("bootstrap_wait", "queue_wait", "forward", "transfer")


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Gauge(
            "pdlife_requests", "Live requests by lifecycle state.", ["state"], registry=r
        )
        self.finished = Counter(
            "pdlife_requests_finished", "Requests that ended, by final state and reason.",
            ["state", "reason"], registry=r,
        )
        for state, reason in OUTCOMES:  # every outcome at 0 before the first request ends
            self.finished.labels(state=state, reason=reason)
        self.phase = Histogram(
            "pdlife_ttft_phase_seconds",
            "Time spent in each TTFT phase (bootstrap wait, queue wait, forward, transfer).",
            ["phase"], buckets=_PHASE_BUCKETS, registry=r,
        )
        for name in _PHASES:  # exported at 0 from the start, so rate() sees the first requests
            self.phase.labels(phase=name)
        self.ttft = Histogram(
            "pdlife_ttft_seconds",
            "Time to first token on the prefill side: admission to the end of the transfer.",
            buckets=_PHASE_BUCKETS, registry=r,
        )
        self.kv_pages_used = Gauge(
            "pdlife_kv_pages_used",
            "KV pages held: by live requests, held back until their transfer is quiet, and by "
            "the prefix cache.", registry=r)
        self.kv_pages_total = Gauge("pdlife_kv_pool_pages", "KV pages in the pool.", registry=r)
        self.kv_usage = Gauge(
            "pdlife_kv_usage_ratio",
            "Fraction of the KV pool in use; prefix-cache pages no request locks count as free "
            "(pdlife_kv_pages_used counts them).", registry=r)
        self.slots_used = Gauge(
            "pdlife_metadata_slots_used", "Metadata-buffer slots held.", registry=r
        )
        self.transfer_bytes = Counter(
            "pdlife_transfer_bytes", "KV and metadata bytes handed to the transfer backend.",
            registry=r,
        )
        self.prefill_tokens = Counter(
            "pdlife_prefill_tokens", "Prompt tokens computed by forward passes.", registry=r
        )
        self.batches = Counter("pdlife_prefill_batches", "Prefill batches run.", registry=r)
        self.probe_bootstraps = Counter(
            "pdlife_probe_bootstraps", "Requests on the fake bootstrap host (2.2.2.2: "
            "/health_generate probes, warm-ups) that bootstrapped, which no decode served; "
            "counted in pdlife_transitions_total{event=\"bootstrapped\"} too.", registry=r,
        )
        self.rejected_input = Counter(
            "pdlife_rejected_inputs", "Requests refused at the boundary, by reason.",
            ["reason"], registry=r,
        )
        self.peer_refusals = Counter(
            "pdlife_peer_refusals", "Rooms this prefill side refused, told to the decode peer "
            "(sent), and requests that failed because the decode peer refused their room "
            "(received).", ["direction"], registry=r,
        )
        # The label values known in advance are exported at 0, so that rate() and alerts see a
        # series (0, not "no data") before the first event.
        for direction in ("sent", "received"):
            self.peer_refusals.labels(direction=direction)
        self.rejected_input.labels(reason="duplicate_rid")
        self.prefix = PrefixCacheMetrics(r)

    def count_transitions(self, fired: Callable[[], Mapping[str, int]]) -> None:
        """Export ``pdlife_transitions_total{event}`` from ``fired`` (the lifecycle's own
        counts, :meth:`lifecycle.Lifecycle.fired_by_event`), read when scraped."""
        self.registry.register(_Transitions(fired))

    def on_finished(self, req: PrefillRequest) -> None:
        state = req.state
        assert state is not None
        reason = req.reason.value if req.reason is not None else ""
        self.finished.labels(state=state.name.lower(), reason=reason).inc()
        if state is PrefillState.FAILED and f"{REASON_PEER_REFUSED}:" in req.detail:
            self.peer_refusals.labels(direction="received").inc()
        if state is PrefillState.DONE:
            phases = ttft_phases(req.timeline)
            if phases.total is not None:
                self.ttft.observe(phases.total)
            for name in _PHASES:
                seconds = getattr(phases, name)
                if seconds is not None:
                    self.phase.labels(phase=name).observe(seconds)

    def set_counts(self, counts: Mapping[enum.IntEnum, int]) -> None:
        for state, n in counts.items():
            self.requests.labels(state=state.name.lower()).set(n)


class _Transitions(Collector):
    """``pdlife_transitions_total{event}``: the lifecycle counts as it fires; this reads the
    counts at scrape time, so firing pays nothing for the series."""

    def __init__(self, fired: Callable[[], Mapping[str, int]]) -> None:
        self._fired = fired

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("pdlife_transitions",
                                     "Lifecycle transitions fired, by event.", labels=["event"])
        for event, n in sorted(self._fired().items()):
            family.add_metric([event], n)
        yield family


class PrefixCacheMetrics:
    """The prefix cache's series (docs/prefix-cache.md); they stay 0 with the cache off."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.hit_tokens = Counter(
            "pdlife_prefix_cache_hit_tokens",
            "Prompt tokens of scheduled requests found in the prefix cache (not computed).",
            registry=r,
        )
        self.query_tokens = Counter(
            "pdlife_prefix_cache_query_tokens",
            "Prompt tokens of requests looked up in the prefix cache when scheduled.", registry=r,
        )
        self.hit_rate = Gauge(
            "pdlife_prefix_cache_hit_rate",
            "Hit tokens over looked-up prompt tokens since the server started.", registry=r,
        )
        self.evicted_pages = Counter(
            "pdlife_prefix_cache_evicted_pages",
            "KV pages the prefix cache evicted to make room for a batch (least recently "
            "used first; not the pages a flush or close gives back).", registry=r,
        )
        self.pages = Gauge(
            "pdlife_prefix_cache_pages", "KV pages the prefix cache owns (tree size).", registry=r
        )
        self.evictable_pages = Gauge(
            "pdlife_prefix_cache_evictable_pages",
            "Prefix-cache pages no live request locks: what eviction could free.", registry=r,
        )
        self._hits = self._queries = 0

    def on_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        self._hits += cached_tokens
        self._queries += prompt_tokens
        self.hit_tokens.inc(cached_tokens)
        self.query_tokens.inc(prompt_tokens)
        self.hit_rate.set(self._hits / self._queries if self._queries else 0.0)
