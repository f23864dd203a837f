"""The metrics of the DP replicas of ``pdlife serve --dp-size``, rank 0's side and a replica's
(:mod:`scheduler.service.metrics`), over real pipes: a replica answers each scrape with its
registry's figures, a scrape waits a bounded time for one that does not answer and shows its
last figures, never has more than one request in flight to it, and does not wait at all for
one whose process ended; the exposition labels every replica's series with its ``dp_rank``,
rank 0's scheduler's included, and leaves the server's own series alone. The server of
several replicas: tests/test_serve_mesh.py and tests/test_serve_dp_delayer.py.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kv.wire import DroppedMessages
from scheduler.prefill.metrics import SchedulerMetrics
from scheduler.sample.grammar import CompileStats
from scheduler.service.metrics import (
    SERVER_FAMILIES,
    DroppedMessagesCollector,
    GrammarCompilesCollector,
    PeerAuthCollector,
    ReplicaMetrics,
    ReplicaScrapes,
    ServiceMetrics,
    answer_scrapes,
    families_of,
    is_server_family,
    replicated_text,
)


@pytest.fixture
def pipe() -> Iterator[tuple[Connection, Connection]]:
    """Rank 0's end and a replica's; a thread that answers on the replica's end ends when
    rank 0's closes."""
    mine, theirs = multiprocessing.Pipe()
    yield mine, theirs
    mine.close()
    for thread in threading.enumerate():
        if thread.name == "pdlife-replica-metrics":
            thread.join(30)
            assert not thread.is_alive()
    theirs.close()


def _finished(scrapes: ReplicaScrapes, timeout: float = 30.0) -> tuple[bool, float | None]:
    """Whether replica 1 answered, and its count of requests finished done (None: no
    figures)."""
    (snapshot,) = scrapes.ask(timeout)
    if snapshot.families is None:
        return snapshot.fresh, None
    (family,) = [f for f in snapshot.families if f.name == "pdlife_requests_finished"]
    (value,) = [v for name, labels, v in family.samples
                if name.endswith("_total") and labels.get("state") == "done"]
    return snapshot.fresh, value


def test_a_replica_answers_every_scrape_with_its_figures_of_then(
        pipe: tuple[Connection, Connection]) -> None:
    mine, theirs = pipe
    metrics = SchedulerMetrics()
    answer_scrapes(theirs, metrics.registry, 1)
    scrapes = ReplicaScrapes([mine], alive=lambda replica: True)
    assert _finished(scrapes) == (True, 0)
    metrics.finished.labels(state="done", reason="").inc(3)
    assert _finished(scrapes) == (True, 3)
    (snapshot,) = scrapes.ask(30)
    assert snapshot.replica == 1 and snapshot.taken is not None
    assert time.time() - snapshot.taken < 30


def test_a_replica_that_does_not_answer_is_waited_for_a_bounded_time_and_asked_once(
        pipe: tuple[Connection, Connection]) -> None:
    mine, theirs = pipe
    scrapes = ReplicaScrapes([mine], alive=lambda replica: True)
    began = time.monotonic()
    for _ in range(3):  # nothing reads the replica's end: a replica stopped or busy
        assert _finished(scrapes, timeout=0.2) == (False, None)
    assert time.monotonic() - began < 10
    # One request in flight, however many scrapes: the pipe does not fill.
    theirs.recv()
    assert not theirs.poll(0)
    # It answers late: the next scrape shows that answer (not fresh) and asks again.
    metrics = SchedulerMetrics()
    metrics.finished.labels(state="done", reason="").inc(2)
    theirs.send((time.time(), families_of(metrics.registry)))
    assert _finished(scrapes, timeout=0.2) == (False, 2)
    # Back to answering: the request in flight is answered, and the scrape after it is fresh.
    metrics.finished.labels(state="done", reason="").inc(1)
    answer_scrapes(theirs, metrics.registry, 1)
    assert _finished(scrapes) == (True, 3)


def test_a_replica_whose_process_ended_shows_its_last_figures_without_a_wait(
        pipe: tuple[Connection, Connection]) -> None:
    mine, theirs = pipe
    metrics = SchedulerMetrics()
    metrics.finished.labels(state="done", reason="").inc(5)
    scrapes = ReplicaScrapes([mine], alive=lambda replica: True)
    assert _finished(scrapes, timeout=0.1) == (False, None)
    theirs.recv()  # it answers one scrape (late), then its process ends
    theirs.send((time.time(), families_of(metrics.registry)))
    theirs.close()  # its end closes with its process
    began = time.monotonic()
    assert _finished(scrapes, timeout=60) == (False, 5)
    assert _finished(scrapes, timeout=60) == (False, 5)
    assert time.monotonic() - began < 30  # read as gone, not waited for


def test_a_replica_not_running_is_not_asked(pipe: tuple[Connection, Connection]) -> None:
    mine, theirs = pipe
    scrapes = ReplicaScrapes([mine], alive=lambda replica: False)
    began = time.monotonic()
    assert _finished(scrapes, timeout=60) == (False, None)
    assert time.monotonic() - began < 30
    assert not theirs.poll(0)
    scrapes.close()
    assert _finished(scrapes, timeout=60) == (False, None)  # closed: nothing is asked


Families = dict[str, list[tuple[str, dict[str, str], float]]]


def scraped(text: str) -> Families:
    """The samples of a Prometheus text (``name``, ``labels``, ``value``), by family; each
    family once."""
    out: Families = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in out, f"{family.name} given twice"
        out[family.name] = [(s.name, s.labels, s.value) for s in family.samples]
    return out


def replica_totals(families: Families, sample: str, **match: str) -> dict[str, float]:
    """The ``sample`` samples whose labels include ``match``, summed per ``dp_rank``."""
    want = set(match.items())
    out: dict[str, float] = {}
    for rows in families.values():
        for name, labels, value in rows:
            if name == sample and want <= set(labels.items()):
                out[labels["dp_rank"]] = out.get(labels["dp_rank"], 0.0) + value
    return out


def check_replica_families(families: Families, dp_size: int) -> None:
    """Every replica has the same families, each sample labelled with its ``dp_rank``, and
    only the server's own families have samples without one."""
    ranked: dict[str, set[str]] = {str(r): set() for r in range(dp_size)}
    for family, rows in families.items():
        for _, labels, _ in rows:
            if "dp_rank" in labels:
                ranked[labels["dp_rank"]].add(family)
            else:
                # The text format gives a family's _created samples a family of their own.
                assert is_server_family(family.removesuffix("_created")), (family, labels)
    assert all(names == ranked["0"] for names in ranked.values()), ranked
    assert {"pdlife_ttft_seconds", "pdlife_requests_finished",
            "pdlife_dp_replica_up"} <= ranked["0"]


def test_the_exposition_labels_every_replicas_series_and_leaves_the_servers_alone(
        pipe: tuple[Connection, Connection]) -> None:
    mine, theirs = pipe
    replica = SchedulerMetrics()
    replica.finished.labels(state="done", reason="").inc(4)
    answer_scrapes(theirs, replica.registry, 1)
    own = SchedulerMetrics()  # rank 0's scheduler, replica 0's, and the service on its registry
    own.finished.labels(state="done", reason="").inc(1)
    service = ServiceMetrics(own.registry)
    service.http_requests.labels(route="/generate", method="POST", status="200").inc()
    scrapes = ReplicaScrapes([mine], alive=lambda replica: True)
    own.registry.register(ReplicaMetrics(scrapes.ask, wait_s=30))
    families = scraped(replicated_text(own.registry).decode())
    assert replica_totals(families, "pdlife_requests_finished_total", state="done") == {
        "0": 1, "1": 4}
    assert replica_totals(families, "pdlife_dp_replica_up") == {"0": 1, "1": 1}
    ages = replica_totals(families, "pdlife_dp_replica_metrics_age_seconds")
    assert sorted(ages) == ["0", "1"] and all(0 <= v < 30 for v in ages.values())
    check_replica_families(families, 2)
    assert [(labels, v) for name, labels, v in families["pdlife_http_requests"]
            if name.endswith("_total")] == [
        ({"route": "/generate", "method": "POST", "status": "200"}, 1)]


def test_the_server_families_are_the_services_own() -> None:
    """Every family the service adds to its engines' registry is the server's, and nothing
    else: a series the service adds later must be placed on one side or the other."""
    registry = CollectorRegistry()
    ServiceMetrics(registry)
    registry.register(DroppedMessagesCollector(lambda: [("prefill", DroppedMessages())]))
    registry.register(PeerAuthCollector(lambda: {"prefill": 0}))
    registry.register(GrammarCompilesCollector(CompileStats))
    names = {f.name for f in registry.collect()}
    assert {n for n in names if is_server_family(n) and not n.startswith("process_")} \
        == SERVER_FAMILIES
    # The transfer backends' drops are a replica's: each replica's first rank exports its own.
    assert names - {n for n in names if is_server_family(n)} == {
        "pdlife_control_messages_dropped"}
    assert not any(map(is_server_family, (f.name for f in SchedulerMetrics().registry.collect())))
