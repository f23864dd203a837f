"""``pdlife top``: the view computed from scraped text (quantiles, rates, the one-minute window,
failures; a prefill of two DP replicas from the exposition ``/metrics`` gives it: whole-server
figures and a line per replica), and runs against a real ``pdlife serve`` worker, a real one of
two DP replicas, and an unreachable one, and Ctrl-C."""

from __future__ import annotations

import math
import re
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from scheduler.cli.main import main
from scheduler.cli.top import _bytes_per_s, _cells, _scrape, render
from scheduler.cli.top_view import History, Scrape, by_label, parse_metrics, quantile, total
from scheduler.model.reference import ModelConfig
from scheduler.prefill.metrics import SchedulerMetrics
from scheduler.service.metrics import (
    ReplicaMetrics,
    ReplicaSnapshot,
    ServiceMetrics,
    families_of,
    replicated_text,
)
from tests.service_harness import (
    PDLIFE,
    Process,
    Server,
    free_port,
    idle,
    model_flags,
    wait_for,
)

MODEL = ModelConfig.tiny()
INFO = {"role": "prefill", "healthy": True, "draining": False, "metadata_slots": 8,
        "requests": {"prefill": {"bootstrapping": 1, "waiting": 0, "forward": 0,
                                 "transferring": 2}},
        "kv_pool": {"prefill": {"used_pages": 16, "free_pages": 48, "total_pages": 64}}}


def test_quantiles_interpolate_within_a_bucket_as_prometheus_does() -> None:
    buckets = {0.1: 5.0, 0.2: 10.0, math.inf: 10.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.99, buckets) == pytest.approx(0.198)
    assert quantile(0.25, buckets) == pytest.approx(0.05)
    assert quantile(0.99, {0.1: 1.0, math.inf: 4.0}) == 0.1  # in +Inf: the largest bound
    assert quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert quantile(0.5, {}) is None


def test_views_from_a_schedulers_real_metrics_text() -> None:
    metrics = SchedulerMetrics()
    history = History("http://w")

    def scrape(at: float, live: int) -> Scrape:
        metrics.requests.labels(state="bootstrapping").set(live)
        return Scrape(at, INFO, parse_metrics(generate_latest(metrics.registry).decode()))

    metrics.finished.labels(state="done", reason="").inc(4)
    first = history.add(scrape(100.0, live=1))
    assert first.admissions_per_s is None and first.ttft_p50 is None  # one scrape: no rates
    assert first.kv_pool == {"prefill": (16, 64)}
    assert first.slots == (0, 8)
    # Two seconds later: 6 more done, 2 failed, 1 more live, 4 GB sent, 6 TTFTs of ~40 ms.
    metrics.finished.labels(state="done", reason="").inc(6)
    metrics.finished.labels(state="failed", reason="transfer_failed").inc(2)
    metrics.transfer_bytes.inc(4e9)
    metrics.slots_used.set(3)
    for _ in range(6):
        metrics.ttft.observe(0.04)
    second = history.add(scrape(102.0, live=2))
    assert second.admissions_per_s == pytest.approx((6 + 2 + 1) / 2)
    assert second.completions_per_s == pytest.approx(3.0)
    assert second.transfer_bytes_per_s == pytest.approx(2e9)
    assert second.failures == {"transfer_failed": 2}
    assert second.slots == (3, 8)
    assert second.ttft_p50 is not None and 0.025 < second.ttft_p50 <= 0.05
    assert second.ttft_p99 is not None and second.ttft_p50 <= second.ttft_p99 <= 0.05
    # A minute and more without requests: the TTFT window is empty again; totals stay.
    third = history.add(scrape(170.0, live=2))
    assert third.ttft_p50 is None and third.completions_per_s == 0.0
    assert third.failures == {"transfer_failed": 2}
    table = render([third, history.unreachable("unreachable (ConnectError: refused)")])
    assert [c.header for c in table.columns] == ["", "http://w", "http://w"]


def test_refusals_before_an_engine_are_shown_beside_the_failures() -> None:
    """A decode that could not look its prefill server up refuses the request before an
    engine takes it: not a failure of the finished counters, a refusal of the HTTP service's
    (exported at 0 from the start, shown once it counts)."""
    metrics = SchedulerMetrics()
    service = ServiceMetrics(metrics.registry)
    view = History("http://w").add(Scrape(0.0, INFO, parse_metrics(
        generate_latest(metrics.registry).decode())))
    assert (view.failures, view.refusals) == ({}, {})
    assert _cells(view)[4:6] == ["none", "none"]
    service.http_rejected.labels(reason="bootstrap_failed").inc(3)
    service.http_rejected.labels(reason="draining").inc()
    view = History("http://w").add(Scrape(1.0, INFO, parse_metrics(
        generate_latest(metrics.registry).decode())))
    assert view.refusals == {"bootstrap_failed": 3, "draining": 1}
    assert _cells(view)[5] == "bootstrap_failed 3, draining 1"


def test_kv_sent_keeps_its_digits_at_every_scale() -> None:
    assert [_bytes_per_s(v) for v in (None, 0.0, 512.0, 3.2e4, 4.56e6, 2e9)] == [
        "—", "0 B/s", "512 B/s", "32.0 kB/s", "4.6 MB/s", "2.0 GB/s"]


def test_the_prefix_cache_is_shown_beside_the_pool_it_lives_in() -> None:
    cached = {**INFO, "kv_pool": {"prefill": {"used_pages": 16, "free_pages": 48,
                                              "total_pages": 64, "prefix_cache_pages": 20}}}
    metrics = SchedulerMetrics()
    metrics.prefix.on_lookup(prompt_tokens=8, cached_tokens=3)  # 37.5% of prompt tokens
    samples = parse_metrics(generate_latest(metrics.registry).decode())
    view = History("http://w").add(Scrape(0.0, cached, samples))
    assert view.prefix_cache_pages == {"prefill": 20}
    assert _cells(view)[7] == "prefill: 16/64 (25%), prefix cache 20, 38% hit"
    plain = History("http://w").add(Scrape(0.0, INFO, {}))
    assert plain.prefix_cache_pages == {} and _cells(plain)[7] == "prefill: 16/64 (25%)"


def test_a_worker_of_several_ranks_says_its_layout() -> None:
    one = History("http://w").add(Scrape(0.0, INFO, {}))
    assert one.layout == "" and "\n" not in _cells(one)[0]
    meshed = {**INFO, "tp_size": 2, "pp_size": 1, "dp_size": 2}
    view = History("http://w").add(Scrape(0.0, meshed, {}))
    assert view.layout == "TP 2 x PP 1 x DP 2, whole-server figures"
    assert _cells(view)[0].endswith("\nTP 2 x PP 1 x DP 2, whole-server figures")


def dp_info(replicas: Mapping[int, tuple[dict[str, int], tuple[int, int, int]]]) -> dict[str, Any]:
    """``/server_info`` of a prefill of two DP replicas, metadata_slots 8, given each replica's
    requests by state and (used, total, prefix-cache) pages of those that gave figures: as the
    route gives them, the sums under ``prefill``, each replica under ``prefill/dp<rank>``."""
    requests: dict[str, dict[str, int]] = {"prefill": {}}
    pools: dict[str, dict[str, int]] = {"prefill": {}}
    for rank, (states, (used, total_, cached)) in replicas.items():
        pool = {"free_pages": total_ - used, "used_pages": used, "total_pages": total_,
                "prefix_cache_pages": cached}
        requests[f"prefill/dp{rank}"], pools[f"prefill/dp{rank}"] = states, pool
        for into, add in ((requests["prefill"], states), (pools["prefill"], pool)):
            for key, n in add.items():
                into[key] = into.get(key, 0) + n
    return {**INFO, "tp_size": 1, "pp_size": 1, "dp_size": 2, "requests": requests,
            "kv_pool": pools}


def test_a_prefill_of_two_dp_replicas_shows_the_whole_server_and_each_replica() -> None:
    """Its /metrics text as the server writes it (every replica's series labelled dp_rank):
    the view sums the replicas, hit rate and slots included, shows requests and pools once
    (the server's ``prefill``, not again its replicas'), and a line per replica, one that did
    not answer the scrape said so with its figures' age."""
    own, replica = SchedulerMetrics(), SchedulerMetrics()  # replica 0's (rank 0's), replica 1's
    ServiceMetrics(own.registry)
    answer: list[ReplicaSnapshot] = []
    own.registry.register(ReplicaMetrics(lambda wait_s: answer, wait_s=0))

    def scrape(at: float, info: dict[str, Any]) -> Scrape:
        return Scrape(at, info, parse_metrics(replicated_text(own.registry).decode()))

    def answered(fresh: bool, age: float = 0.0) -> None:
        answer[:] = [ReplicaSnapshot(1, families_of(replica.registry), time.time() - age, fresh)]

    # Replica 1 still loading: no figures of its own yet, replica 0's alone.
    own.slots_used.set(3)
    own.prefix.on_lookup(prompt_tokens=10, cached_tokens=4)
    answer[:] = [ReplicaSnapshot(1, None, None, fresh=False)]
    alone = History("http://w").add(scrape(98.0, dp_info({0: ({"waiting": 1}, (6, 64, 2))})))
    assert alone.slots == (3, 8) and alone.prefix_hit_rate == pytest.approx(0.4)
    assert _cells(alone)[10].split("\n") == [
        "dp0: 1 live, KV 6/64 (9%), slots 3/8", "dp1: no figures yet, [bold red]not answering[/]"]

    history = History("http://w")
    own.finished.labels(state="done", reason="").inc(2)
    replica.finished.labels(state="done", reason="").inc(4)
    replica.finished.labels(state="failed", reason="transfer_failed").inc()
    replica.slots_used.set(5)
    replica.prefix.on_lookup(prompt_tokens=30, cached_tokens=6)
    replica.transfer_bytes.inc(1000)
    answered(fresh=True)
    info = dp_info({0: ({"waiting": 1, "transferring": 0}, (6, 64, 2)),
                    1: ({"waiting": 0, "transferring": 2}, (10, 64, 4))})
    first = history.add(scrape(100.0, info))
    assert first.requests == {"prefill": {"waiting": 1, "transferring": 2}}
    assert first.kv_pool == {"prefill": (16, 128)} and first.prefix_cache_pages == {"prefill": 6}
    assert first.slots == (8, 16)  # each replica has its 8
    assert first.prefix_hit_rate == pytest.approx(10 / 40)  # both replicas' tokens
    assert first.failures == {"transfer_failed": 1}
    assert [(r.rank, r.live, r.kv_pool, r.slots, r.answered) for r in first.replicas] == [
        (0, 1, (6, 64), (3, 8), True), (1, 2, (10, 64), (5, 8), True)]
    cells = _cells(first)
    assert cells[0].endswith("\nTP 1 x PP 1 x DP 2, whole-server figures")
    assert cells[1] == "prefill: waiting 1, transferring 2"
    assert cells[7] == "prefill: 16/128 (12%), prefix cache 6, 25% hit"
    assert cells[8] == "8/16"
    assert cells[10] == ("dp0: 1 live, KV 6/64 (9%), slots 3/8\n"
                         "dp1: 2 live, KV 10/64 (16%), slots 5/8")
    # Two seconds later replica 1 did not answer: its figures are its last answer's.
    own.finished.labels(state="done", reason="").inc(2)
    own.transfer_bytes.inc(3000)
    answered(fresh=False, age=12.0)
    second = history.add(scrape(102.0, info))
    assert second.completions_per_s == pytest.approx(1.0)
    assert second.transfer_bytes_per_s == pytest.approx(1500.0)
    assert second.failures == {"transfer_failed": 1} and second.slots == (8, 16)
    (dp0, dp1) = second.replicas
    assert dp0.answered and not dp1.answered
    assert dp1.age_s is not None and 12 <= dp1.age_s < 60
    assert re.fullmatch(r"dp1: 2 live, KV 10/64 \(16%\), slots 5/8, \[bold red\]not answering"
                        r"\[/\] \(figures 1[2-9] s old\)", _cells(second)[10].split("\n")[1])
    table = render([second, History("http://one").add(Scrape(0.0, INFO, {}))])
    assert table.row_count == 11  # the DP replicas' row, "—" for the worker of one
    assert render([History("http://one").add(Scrape(0.0, INFO, {}))]).row_count == 10


def test_a_worker_that_restarted_counts_its_new_histogram() -> None:
    history = History("http://w")
    before = SchedulerMetrics()
    for _ in range(50):
        before.ttft.observe(2.0)
    history.add(Scrape(0.0, INFO, parse_metrics(generate_latest(before.registry).decode())))
    after = SchedulerMetrics()  # the worker restarted: its counters began again
    after.ttft.observe(0.003)
    view = history.add(Scrape(1.0, INFO, parse_metrics(generate_latest(after.registry).decode())))
    assert view.ttft_p99 is not None and view.ttft_p99 <= 0.005


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("top") / "serve.log", "--backend", "local",
                    "--hidden", str(MODEL.hidden), "--heads", str(MODEL.heads), "--kv-heads",
                    str(MODEL.kv_heads), "--head-dim", str(MODEL.head_dim), "--intermediate",
                    str(MODEL.intermediate), "--log-level", "warning")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def _generate(url: str, n: int) -> None:
    for i in range(n):
        r = httpx.post(f"{url}/generate", timeout=30, json={
            "input_ids": [i + 1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text


@pytest.mark.multiprocess
def test_a_real_worker_is_read_between_requests(worker: Server) -> None:
    history = History(worker.url)
    with httpx.Client(timeout=5) as client:
        first = _scrape(client, history)
        assert first.error is None and first.role == "both" and first.healthy
        assert set(first.requests) == {"prefill", "decode"}
        _generate(worker.url, 3)
        second = _scrape(client, history)
    assert second.completions_per_s is not None and second.completions_per_s > 0
    assert second.ttft_p50 is not None and second.ttft_p50 > 0
    assert second.transfer_bytes_per_s is not None and second.transfer_bytes_per_s > 0
    assert second.kv_pool["decode"][1] > 0


@pytest.mark.multiprocess
def test_a_real_prefill_of_two_dp_replicas_is_read_as_one_server_and_per_replica(
    tmp_path: Path,
) -> None:
    server = Server(tmp_path / "serve.log", "--role", "prefill", "--backend", "fake",
                    *model_flags(MODEL), "--page-size", "4", "--dp-size", "2",
                    "--log-level", "warning")
    try:
        server.wait_healthy(timeout=180)
        history = History(server.url)
        with httpx.Client(timeout=60) as client:
            assert _scrape(client, history).error is None
            # One prompt four times, one after another: the fake backend's rooms count up, so
            # the requests alternate between the replicas, and each replica's second request
            # finds the first one's whole pages in its prefix cache.
            for _ in range(4):
                r = client.post(f"{server.url}/generate", json={
                    "input_ids": list(range(1, 10)), "sampling_params": {"max_new_tokens": 1}})
                assert r.status_code == 200, r.text
            wait_for(lambda: idle(server.get("/server_info")), 30, "the pool free again")
            view = _scrape(client, history)
            gauges = by_label(parse_metrics(client.get(f"{server.url}/metrics").text),
                              "pdlife_prefix_cache_hit_rate", "dp_rank")
        info = server.get("/server_info")
    finally:
        server.stop()
    pages, slots = info["pool_pages"], info["metadata_slots"]
    assert view.error is None and view.layout == "TP 1 x PP 1 x DP 2, whole-server figures"
    assert set(view.requests) == {"prefill"} and view.kv_pool["prefill"][1] == 2 * pages
    assert view.slots is not None and view.slots[1] == 2 * slots
    # Both replicas looked the same prompts up and hit alike: the server's rate is theirs.
    assert sorted(gauges) == ["0", "1"] and gauges["0"] == gauges["1"] > 0
    assert view.prefix_hit_rate == pytest.approx(gauges["0"])
    assert view.completions_per_s is not None and view.completions_per_s > 0
    assert [(r.rank, r.live, r.kv_pool and r.kv_pool[1], r.slots and r.slots[1], r.answered)
            for r in view.replicas] == [(0, 0, pages, slots, True), (1, 0, pages, slots, True)]


@pytest.mark.multiprocess
def test_pdlife_top_runs_a_bounded_number_of_refreshes_and_names_the_unreachable(
    worker: Server, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["top", worker.url, "--iterations", "2", "--interval", "0.1"]) == 0
    out = capsys.readouterr().out
    assert worker.url in out and "healthy" in out and "TTFT p50 / p99" in out
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["top", worker.url.removeprefix("http://"), dead, "--once",
                 "--interval", "0.1"]) == 1
    out = capsys.readouterr().out
    assert "unreachable (ConnectError" in out
    assert "both, healthy" in out


@pytest.mark.multiprocess
def test_ctrl_c_ends_pdlife_top_cleanly(worker: Server, tmp_path: Path) -> None:
    def info_reads() -> float:
        text = httpx.get(f"{worker.url}/metrics", timeout=5).text
        return total(parse_metrics(text), "pdlife_http_requests_total", route="/server_info")

    before = info_reads()
    top = Process([sys.executable, "-c", PDLIFE, "top", worker.url, "--interval", "0.1"],
                  tmp_path / "top.log", env={"COLUMNS": "200"})
    try:
        wait_for(lambda: info_reads() >= before + 2, 60, "pdlife top refreshing")
        top.check_alive("pdlife top")
        top.signal(signal.SIGINT)
        assert top.wait(timeout=30) == 0, top.tail()
        out = top.tail(100_000)  # the whole screen, the header row included
        assert "Traceback" not in out and "KeyboardInterrupt" not in out
        assert worker.url in out
    finally:
        top.stop()


@pytest.mark.parametrize(("flags", "says"), [
    (("--interval", "0"), "--interval must be > 0, got 0.0"),
    (("--timeout", "-1"), "--timeout must be > 0, got -1.0"),
    (("--iterations", "-2"), "--iterations must be >= 0, got -2"),
])
def test_top_names_the_value_it_refuses(flags: tuple[str, ...], says: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """It named every rule whichever was broken."""
    with pytest.raises(SystemExit) as info:
        main(["top", "http://127.0.0.1:9", *flags])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(says)


@pytest.mark.parametrize("address", ["notaurl:::", "http://[::1", "ftp://localhost:9",
                                     "localhost:0", "http://", "localhost:99999"])
def test_top_refuses_an_address_that_is_not_a_url(address: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["top", "--once", address])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdlife top: {address!r} is not a worker's address (")
    assert err.count("\n") == 1
