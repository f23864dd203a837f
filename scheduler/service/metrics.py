"""Prometheus metrics of the HTTP service (names prefixed ``pdlife_``).

They live in the registry of the service's engines (the prefill scheduler's, else the decode
peer's, whose own series are :class:`~scheduler.decode.metrics.DecodeMetrics`), so ``/metrics``
is one registry.

The DP replicas of ``pdlife serve --dp-size D``
-----------------------------------------------
Replica 0's scheduler runs in the serving process; each other replica's runs in its first
rank's process (:mod:`scheduler.service.ranks`). ``/metrics`` covers them all: rank 0 keeps one
pipe to each other replica's first rank (:class:`ReplicaScrapes`), and a scrape sends one
request down each and waits, for at most :data:`REPLICA_WAIT_S` together, for the families of
that replica's registry, which a thread of its own reads and sends back
(:func:`answer_scrapes`; the replica's scheduler loop is not involved, idle, busy or waiting
in the delayer's gather). At most one request is in flight on a pipe: a replica that has not
answered the last one is not asked again, so neither the pipe nor its backlog grows however
often the server is scraped. The answers reach ``/metrics`` through a collector on rank 0's
registry (:class:`ReplicaMetrics`), every sample labelled with its replica's ``dp_rank``, and
:func:`by_replica` gives rank 0's own scheduler families ``dp_rank="0"`` and merges each name
into one family; the server's own families (:data:`SERVER_FAMILIES`: HTTP, health, the
bootstrap endpoint, the grammar compiler, the serving process) keep no ``dp_rank``. A replica
that did not answer in time (busy beyond the wait, stopped, dead) shows the figures of its last
answer, none before its first, and ``pdlife_dp_replica_up{dp_rank} 0``;
``pdlife_dp_replica_metrics_age_seconds{dp_rank}`` says how old each replica's figures are.
A server of one replica exports what it always did, without ``dp_rank``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

import attrs
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kv.wire import DroppedMessages

if TYPE_CHECKING:
    from scheduler.sample.grammar import CompileStats

logger = logging.getLogger(__name__)

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


# -- the DP replicas -------------------------------------------------------------------------

#: How long a scrape (``/metrics``, ``/server_info``) waits for the other DP replicas' answers,
#: all together; a replica that has not answered by then shows its last figures.
REPLICA_WAIT_S = 2.0
#: The label that says which DP replica a series is of (SGLang's name for it).
DP_RANK = "dp_rank"
#: The server's own families, not a DP replica's: they keep no ``dp_rank`` (:func:`by_replica`),
#: as do ``process_*`` and ``python_*``. Every other family of rank 0's registry is its
#: scheduler's, replica 0's.
SERVER_FAMILIES = frozenset({
    "pdlife_http_requests", "pdlife_http_request_seconds", "pdlife_http_rejected",
    "pdlife_service_healthy", "pdlife_service_draining", "pdlife_peer_auth_failures",
    "pdlife_grammar_compiles",
})
_SERVER_PREFIXES = ("process_", "python_")
_UP = "pdlife_dp_replica_up"
_AGE = "pdlife_dp_replica_metrics_age_seconds"


def is_server_family(name: str) -> bool:
    """Whether family ``name`` is the server's own, not a DP replica's."""
    return name in SERVER_FAMILIES or name.startswith(_SERVER_PREFIXES)


@attrs.frozen
class Family:
    """A metric family as plain data: what a replica's first rank sends rank 0."""

    name: str
    documentation: str
    type: str
    unit: str
    #: ``(sample name, labels, value)`` each.
    samples: tuple[tuple[str, dict[str, str], float], ...]

    @classmethod
    def of(cls, metric: Metric) -> Family:
        return cls(metric.name, metric.documentation, metric.type, metric.unit,
                   tuple((s.name, dict(s.labels), s.value) for s in metric.samples))

    def labelled(self, **labels: str) -> Metric:
        """This family with ``labels`` on every sample."""
        metric = Metric(self.name, self.documentation, self.type, self.unit)
        for name, own, value in self.samples:
            metric.add_sample(name, {**own, **labels}, value)
        return metric


def families_of(registry: CollectorRegistry) -> tuple[Family, ...]:
    """What ``registry`` exports now, as plain data."""
    return tuple(map(Family.of, registry.collect()))


@attrs.frozen
class ReplicaSnapshot:
    """What rank 0 knows of DP replica ``replica``'s metrics after a scrape."""

    replica: int
    #: Its last answer's families; None before its first answer.
    families: tuple[Family, ...] | None
    #: When the replica read them (``time.time()``, this host's clock); None with no families.
    taken: float | None
    #: Whether it read them during this scrape (else they are an earlier scrape's).
    fresh: bool


def answer_scrapes(end: Connection, registry: CollectorRegistry, replica: int) -> None:
    """On DP replica ``replica``'s first rank: answer each request rank 0 sends on ``end`` with
    ``(time.time(), families_of(registry))``, on a daemon thread of its own, until rank 0
    closes its end or this process ends. ``registry`` is read as ``/metrics`` reads rank 0's
    (its metrics are thread-safe): the scheduler's loop is never involved."""

    def serve() -> None:
        while True:
            try:
                end.recv()
            except (EOFError, OSError):  # rank 0 closed its end: the server stops
                return
            answer: tuple[float, tuple[Family, ...]] | None
            try:
                answer = (time.time(), families_of(registry))
            except Exception:  # rank 0 shows the last figures; the next scrape tries again
                logger.exception("reading the metrics of replica %d failed", replica)
                answer = None
            try:
                end.send(answer)
            except OSError:
                return

    threading.Thread(target=serve, name="pdlife-replica-metrics", daemon=True).start()


class ReplicaScrapes:
    """Rank 0's side of the other DP replicas' metrics pipes: ``ends[i]`` is replica
    ``i + 1``'s, ``alive(replica)`` whether its first rank's process still runs. Thread-safe:
    one scrape at a time asks the replicas."""

    def __init__(self, ends: Sequence[Connection], alive: Callable[[int], bool]) -> None:
        self._ends = list(ends)
        self._alive = alive
        self._lock = threading.Lock()
        self._closed = False
        n = len(self._ends)
        self._asked = [False] * n  # a request in flight, not yet answered
        self._gone = [False] * n  # its process ended: never asked again
        self._last: list[tuple[float, tuple[Family, ...]] | None] = [None] * n

    def ask(self, timeout: float) -> list[ReplicaSnapshot]:
        """Every other replica's figures, fresh from those that answer within ``timeout``
        seconds (all together, a wait for a scrape already asking included), the last ones
        from the others. Fresh: read by the replica since this call began (another
        scrape's answers that came meanwhile are fresh too)."""
        began, deadline = time.time(), time.monotonic() + timeout
        if self._lock.acquire(timeout=timeout):
            try:
                if not self._closed:
                    self._scrape(deadline)
            finally:
                self._lock.release()
        snapshots = []
        for i, last in enumerate(self._last):
            if last is None:
                snapshots.append(ReplicaSnapshot(i + 1, None, None, fresh=False))
            else:
                taken, families = last
                snapshots.append(ReplicaSnapshot(i + 1, families, taken, taken >= began))
        return snapshots

    def _scrape(self, deadline: float) -> None:
        waiting: dict[Connection, int] = {}
        for i, end in enumerate(self._ends):
            if self._asked[i] and end.poll(0):  # a late answer to an earlier scrape
                self._receive(i)
            if self._gone[i]:
                continue
            if not self._asked[i]:
                if not self._alive(i + 1):
                    self._gone[i] = True
                    continue
                try:
                    end.send(None)
                except OSError:
                    self._gone[i] = True
                    continue
                self._asked[i] = True
            waiting[end] = i
        while waiting and (left := deadline - time.monotonic()) > 0:
            for ready in wait(list(waiting), left):
                assert isinstance(ready, Connection)
                self._receive(waiting.pop(ready))

    def _receive(self, i: int) -> None:
        """Read replica ``i + 1``'s answer to its request (None: it could not read its
        figures), or find it gone."""
        self._asked[i] = False
        try:
            answer = self._ends[i].recv()
        except (EOFError, OSError):  # its process ended
            self._gone[i] = True
            return
        if answer is not None:
            self._last[i] = answer

    def close(self) -> None:
        """Close rank 0's ends (a scrape under way finishes first); later scrapes show the
        last figures."""
        with self._lock:
            self._closed = True
            for end in self._ends:
                end.close()


class ReplicaMetrics(Collector):
    """The other DP replicas' families (``ask``: :meth:`ReplicaScrapes.ask`), each sample
    labelled with its replica's ``dp_rank``, and per replica (0, this process, included)
    ``pdlife_dp_replica_up`` and ``pdlife_dp_replica_metrics_age_seconds``.

    :meth:`collect` waits up to ``wait_s`` for the replicas: read a registry that holds this
    collector off the event loop and off the engine thread, and through :func:`by_replica`,
    which merges its families with rank 0's of the same names."""

    def __init__(self, ask: Callable[[float], Sequence[ReplicaSnapshot]],
                 wait_s: float = REPLICA_WAIT_S) -> None:
        self._ask = ask
        self._wait_s = wait_s

    def collect(self) -> Iterator[Metric]:
        snapshots = self._ask(self._wait_s)
        now = time.time()
        up = GaugeMetricFamily(
            _UP, "1 when the DP replica's series were read during this scrape (within its "
            "wait; always for replica 0, the serving process's), else 0: they are its last "
            "answer's, or absent before its first.", labels=[DP_RANK])
        age = GaugeMetricFamily(
            _AGE, "Seconds since the DP replica read the figures its series show.",
            labels=[DP_RANK])
        up.add_metric(["0"], 1)
        age.add_metric(["0"], 0)
        for snapshot in snapshots:
            rank = str(snapshot.replica)
            up.add_metric([rank], float(snapshot.fresh))
            if snapshot.families is None or snapshot.taken is None:
                continue
            age.add_metric([rank], max(0.0, now - snapshot.taken))
            for family in snapshot.families:
                yield family.labelled(**{DP_RANK: rank})
        yield up
        yield age


def by_replica(families: Iterable[Metric]) -> list[Metric]:
    """``families`` (a DP server's registry, :class:`ReplicaMetrics` among it) as one family
    per name, a DP replica's samples labelled with its ``dp_rank``: a sample of a replica's
    family without one is rank 0's own scheduler's, replica 0's. The server's own families
    (:func:`is_server_family`) stay as they are."""
    merged: dict[str, Metric] = {}
    for family in families:
        into = merged.get(family.name)
        if into is None:
            into = merged[family.name] = Metric(family.name, family.documentation,
                                                family.type, family.unit)
        server = is_server_family(family.name)
        for sample in family.samples:
            if not server and DP_RANK not in sample.labels:
                sample = sample._replace(labels={**sample.labels, DP_RANK: "0"})
            into.samples.append(sample)
    return list(merged.values())


class _Families(Collector):
    """Families already collected, for :func:`generate_latest`."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def replicated_text(registry: CollectorRegistry) -> bytes:
    """Prometheus text of a DP server's ``registry``, through :func:`by_replica` (it waits for
    the replicas: off the event loop)."""
    return generate_latest(_Families(by_replica(registry.collect())))
