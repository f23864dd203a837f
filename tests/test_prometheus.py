"""A real Prometheus (Debian's ``prometheus``) scrapes a ``pdlife serve`` prefill and decode pair
over Mooncake, with the scrape config docs/operations.md ships, and a prefill of two DP replicas
(``--dp-size 2``, a job of its own) that the same decode pairs with; after some traffic the test
reads back, through Prometheus' query API, requests finished by reason, a TTFT phase quantile,
KV bytes sent and pool usage, and every query of docs/grafana-dashboard.json returns series,
each with a legend of its own; what a dashboard query or an alert reads of the prefill of one
replica, it reads of the prefill of two (a query that matches a series labelled ``dp_rank``
with one that is not reads nothing there), and a DP replica that stops answering is alerted on.
The decode's KV pool rule reads the decode worker's series, and a request that waits for a
decode destination that never comes is alerted on (that rule's windows shortened, so that the
test need not wait five minutes).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from scheduler.model.reference import ModelConfig
from tests.service_harness import ROOT, Process, Server, free_port, wait_for
from tests.test_serve_mesh import _rank_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.mooncake, pytest.mark.slow]

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
MODEL = ModelConfig.tiny()
POOL_PAGES = 512
COMMON = ["--backend", "mooncake", "--page-size", "4", "--chunked-prefill-size", "16",
          "--pool-pages", str(POOL_PAGES), "--hidden", str(MODEL.hidden), "--heads",
          str(MODEL.heads), "--kv-heads", str(MODEL.kv_heads), "--head-dim",
          str(MODEL.head_dim), "--intermediate", str(MODEL.intermediate), "--log-level",
          "warning"]
PAIRS = 6
#: The job of the prefill of two DP replicas. It is scraped every 3 s, with a timeout of 3 s: a
#: scrape of it waits up to 2 s for a replica that does not answer, and the others' timeout is
#: their interval, 1 s (a scrape may take no longer than its interval).
DP_JOB, DP_INTERVAL = "pdlife-prefill-dp", "3s"
#: PdlifeRequestsWaitingForDecode's windows in the test's copy of the rules: three scrapes of
#: the DP job, where the rules file says five minutes.
WAITING_WINDOW = "10s"


def scrape_config(prefill: str, decode: str, dp: str) -> str:
    """docs/operations.md's prometheus.yml, scraping ``prefill`` and ``decode`` every second,
    plus a job of its own for ``dp``, the prefill of two DP replicas."""
    doc = (ROOT / "docs" / "operations.md").read_text()
    match = re.search(r"```yaml\n# prometheus.yml\n(.*?)```", doc, re.DOTALL)
    assert match, "docs/operations.md has no prometheus.yml block"
    text = match.group(1)
    for default, target in (("127.0.0.1:30000", prefill), ("127.0.0.1:30001", decode)):
        assert default in text
        text = text.replace(default, target)
    config = yaml.safe_load(text.replace("scrape_interval: 5s", "scrape_interval: 1s").replace(
        "evaluation_interval: 15s", "evaluation_interval: 1s"))
    config["scrape_configs"].append({"job_name": DP_JOB, "scrape_interval": DP_INTERVAL,
                                     "scrape_timeout": DP_INTERVAL,
                                     "static_configs": [{"targets": [dp]}]})
    return str(yaml.safe_dump(config, sort_keys=False))


def alert_rules() -> list[dict[str, Any]]:
    """The rules of docs/prometheus-alerts.yml (``promtool check rules`` accepts them)."""
    path = ROOT / "docs" / "prometheus-alerts.yml"
    check = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    rules: list[dict[str, Any]] = [
        r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]
    return rules


def rules_for_the_test() -> str:
    """docs/prometheus-alerts.yml with PdlifeRequestsWaitingForDecode's windows shortened to
    ``WAITING_WINDOW``, so that it fires within seconds of the last bootstrapped request."""
    rules = yaml.safe_load((ROOT / "docs" / "prometheus-alerts.yml").read_text())
    (rule,) = [r for g in rules["groups"] for r in g["rules"]
               if r["alert"] == "PdlifeRequestsWaitingForDecode"]
    assert rule["expr"].count("[5m]") == 3, rule["expr"]
    rule["expr"] = rule["expr"].replace("[5m]", f"[{WAITING_WINDOW}]")
    return str(yaml.safe_dump(rules, sort_keys=False))


def dashboard_targets(job: str | None = None) -> list[tuple[str, str]]:
    """Every panel's query as Grafana sends it with ``job`` chosen in the dashboard's job
    variable (None: "All", the variable's ``allValue``), and its legend format."""
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "job"]
    chosen = variable["allValue"] if job is None else job
    return [(t["expr"].replace("$job", chosen), t["legendFormat"])
            for p in dashboard["panels"] for t in p["targets"]]


def dashboard_queries(job: str | None = None) -> list[str]:
    return [expr for expr, _ in dashboard_targets(job)]


def legend(form: str, labels: dict[str, str]) -> str:
    """A series' name as Grafana's Prometheus data source writes it from a legend format: each
    ``{{label}}`` its value, empty for a label the series lacks."""
    return re.sub(r"\{\{\s*(.+?)\s*\}\}", lambda m: labels.get(m.group(1), ""), form)


def measured(expr: str) -> str:
    """An alert's expression without its final threshold (``... > 0.05``): what it measures."""
    match = re.fullmatch(r"(.*?)\s*(?:==|!=|>=|<=|>|<)\s*[0-9.]+\s*", expr, re.DOTALL)
    assert match, f"{expr!r} does not end with a threshold"
    return match.group(1)


class Prometheus(Process):
    def __init__(self, tmp: Path, config: str) -> None:
        (tmp / "prometheus.yml").write_text(config)
        (tmp / "prometheus-alerts.yml").write_text(rules_for_the_test())
        self.url = f"http://127.0.0.1:{free_port()}"
        super().__init__([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp / 'data'}",
                          f"--web.listen-address={self.url.removeprefix('http://')}"],
                         tmp / "prometheus.log")

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        r.raise_for_status()
        result: list[dict[str, Any]] = r.json()["data"]["result"]
        return result

    def value(self, expr: str) -> float:
        """The one sample ``expr`` gives."""
        (sample,) = self.query(expr)
        return float(sample["value"][1])

    def ready(self) -> bool:
        self.check_alive("prometheus")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False


def test_prometheus_scrapes_a_prefill_decode_pair_and_the_dashboard_has_data(
    tmp_path: Path,
) -> None:
    assert Path(PROMETHEUS).exists(), "install Debian's prometheus (make system-deps)"
    bootstrap_port, dp_bootstrap_port = free_port(), free_port()
    prefill = Server(tmp_path / "prefill.log", "--role", "prefill", "--bootstrap-port",
                     str(bootstrap_port), "--bootstrap-timeout", "1", *COMMON)
    dp = Server(tmp_path / "prefill-dp.log", "--role", "prefill", "--bootstrap-port",
                str(dp_bootstrap_port), "--dp-size", "2", *COMMON)
    decode = Server(tmp_path / "decode.log", "--role", "decode", *COMMON)
    prometheus = Prometheus(tmp_path, scrape_config(*(
        server.url.removeprefix("http://") for server in (prefill, decode, dp))))
    stopped: list[int] = []
    waiting = ThreadPoolExecutor(1)
    try:
        for server in (prefill, dp, decode):
            server.wait_healthy()
        wait_for(prometheus.ready, 60, "prometheus ready")
        wait_for(lambda: len(prometheus.query('up{job=~"pdlife-.*"} == 1')) == 3, 30,
                 "the three workers scraped")

        def body(room: int, n: int, port: int = bootstrap_port) -> dict[str, Any]:
            return {"input_ids": [(7 * room + k) % 250 + 1 for k in range(n)],
                    "rid": f"r{room}", "sampling_params": {"max_new_tokens": 3,
                                                           "ignore_eos": True},
                    "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
                    "bootstrap_room": room}

        def post(url: str, b: dict[str, Any]) -> int:
            return httpx.post(f"{url}/generate", json=b, timeout=60).status_code

        # The DP prefill's rooms alternate between its replicas (room % 2).
        dp_rooms = range(101, 101 + PAIRS)
        with ThreadPoolExecutor(4 * PAIRS + 1) as pool:
            calls = [pool.submit(post, server.url, body(room, 40))
                     for room in range(1, PAIRS + 1) for server in (prefill, decode)]
            calls += [pool.submit(post, server.url, body(room, 40, dp_bootstrap_port))
                      for room in dp_rooms for server in (dp, decode)]
            # No decode server asks for this room: prefill times its bootstrap out.
            orphan = pool.submit(post, prefill.url, body(PAIRS + 1, 20))
            assert [c.result() for c in calls] == [200] * (4 * PAIRS)
            assert orphan.result() == 500
        # Nor for this one, on the DP prefill's replica 0 (an even room): it waits for its
        # destination (300 s) until it is aborted below (PdlifeRequestsWaitingForDecode).
        waiting_body = body(200, 20, dp_bootstrap_port)
        waiting_answer = waiting.submit(httpx.post, f"{dp.url}/generate", json=waiting_body,
                                        timeout=120)

        queries = dashboard_queries()

        def done_by_replica() -> dict[str, float]:
            return {s["metric"]["dp_rank"]: float(s["value"][1]) for s in prometheus.query(
                f'sum by (dp_rank) (pdlife_requests_finished_total{{job="{DP_JOB}"}})')}

        def scraped() -> bool:
            total = prometheus.query('sum(pdlife_requests_finished_total{job="pdlife-prefill"})')
            return (bool(total) and float(total[0]["value"][1]) == PAIRS + 1
                    and done_by_replica() == {"0": PAIRS / 2, "1": PAIRS / 2}
                    and all(prometheus.query(q) for q in queries))

        wait_for(scraped, 60, "the traffic scraped and every dashboard query answered")
        # The job variable lists the workers, and choosing one keeps the others' series out.
        jobs = httpx.get(f"{prometheus.url}/api/v1/label/job/values",
                         params={"match[]": 'up{job=~"pdlife-.*"}'}, timeout=10).json()["data"]
        assert sorted(jobs) == ["pdlife-decode", "pdlife-prefill", DP_JOB]
        for job in jobs:
            found = {s["metric"]["job"] for q in dashboard_queries(job)
                     for s in prometheus.query(q) if "job" in s["metric"]}
            assert found == {job}, (job, found)
        # What a panel shows of the prefill of one replica, it shows of the prefill of two: a
        # query that divides or matches a series labelled dp_rank by one without it (or
        # aggregates the two sides apart) answers nothing there.
        missing = [q for q, q_dp in zip(dashboard_queries("pdlife-prefill"),
                                        dashboard_queries(DP_JOB), strict=True)
                   if prometheus.query(q) and not prometheus.query(q_dp)]
        assert missing == [], missing
        # Each series of a panel's query has a legend of its own (every replica's too).
        for expr, form in dashboard_targets():
            legends = [legend(form, s["metric"]) for s in prometheus.query(expr)]
            assert len(set(legends)) == len(legends), (expr, form, legends)

        # Every outcome is exported from the start, at 0 until it happens.
        finished = {(s["metric"]["state"], s["metric"].get("reason", "")): float(s["value"][1])
                    for s in prometheus.query(
                        'pdlife_requests_finished_total{job="pdlife-prefill"}')
                    if float(s["value"][1])}
        # Prometheus drops empty labels: a request that finished well has no reason.
        assert finished == {("done", ""): PAIRS, ("failed", "bootstrap_timeout"): 1}
        assert prometheus.value(
            'pdlife_decode_requests_finished_total{state="done"}') == 2 * PAIRS
        for phase in ("bootstrap_wait", "queue_wait", "forward", "transfer"):
            p99 = prometheus.value(
                "histogram_quantile(0.99, sum by (le) (rate("
                f'pdlife_ttft_phase_seconds_bucket{{phase="{phase}"}}[1m])))')
            assert math.isfinite(p99) and p99 > 0, phase
        assert prometheus.value(
            'pdlife_ttft_phase_seconds_count{job="pdlife-prefill", phase="transfer"}') == PAIRS
        assert prometheus.value('pdlife_transfer_bytes_total{job="pdlife-prefill"}') > 0
        assert prometheus.value('pdlife_kv_pool_pages{job="pdlife-prefill"}') == POOL_PAGES
        assert prometheus.value(
            f'sum(pdlife_kv_pool_pages{{job="{DP_JOB}"}})') == 2 * POOL_PAGES
        # The decode worker exports its pool's size.
        assert prometheus.value('pdlife_decode_kv_pool_pages{job="pdlife-decode"}') == POOL_PAGES
        assert 0 <= prometheus.value('pdlife_kv_usage_ratio{job="pdlife-prefill"}') <= 1

        # Every alert rule is loaded and evaluates, and every series it reads is scraped (a
        # misspelt name would make an alert that can never fire).
        rules = alert_rules()

        def evaluated() -> list[tuple[str, str]]:
            groups = httpx.get(f"{prometheus.url}/api/v1/rules", timeout=10).json()
            return [(r["name"], r["health"]) for g in groups["data"]["groups"]
                    for r in g["rules"]]

        wait_for(lambda: all(health != "unknown" for _, health in evaluated()), 30,
                 "every rule evaluated")
        assert evaluated() == [(r["alert"], "ok") for r in rules]
        names = {n for r in rules for n in re.findall(r"\b(?:pdlife|process)_[a-z_]+", r["expr"])}
        assert len(names) >= 8, names
        for name in sorted(names):
            assert prometheus.query(f'count({{__name__="{name}"}})'), f"{name} is not scraped"
        # What an alert measures of the prefill of one replica, it measures of the prefill of
        # two (below its threshold, so its series are there whether it fires or not).
        jobs_read_by: dict[str, set[str | None]] = {}
        for rule in rules:
            jobs_read = {s["metric"].get("job") for s in prometheus.query(measured(rule["expr"]))}
            assert "pdlife-prefill" not in jobs_read or DP_JOB in jobs_read, (rule, jobs_read)
            jobs_read_by[rule["alert"]] = jobs_read
        # The decode's pool is read on the decode worker (a prefill has none), the wait for
        # destinations on every prefill.
        assert jobs_read_by["PdlifeDecodeKVPoolFull"] == {"pdlife-decode"}
        assert jobs_read_by["PdlifeRequestsWaitingForDecode"] == {"pdlife-prefill", DP_JOB}

        def alerts(name: str) -> list[dict[str, str]]:
            """The labels of ``name``'s alerts, pending or firing."""
            found = httpx.get(f"{prometheus.url}/api/v1/alerts", timeout=10).json()
            return [a["labels"] for a in found["data"]["alerts"]
                    if a["labels"]["alertname"] == name]

        # The request waiting for a destination is alerted on, for its replica, once no request
        # of that replica was bootstrapped within the window.
        wait_for(lambda: any((a["job"], a.get("dp_rank")) == (DP_JOB, "0")
                             for a in alerts("PdlifeRequestsWaitingForDecode")), 30,
                 "the request waiting for a destination alerted on")
        assert httpx.post(f"{dp.url}/abort_request", json={"rid": waiting_body["rid"]},
                          timeout=10).json()["aborted"] == 1
        aborted = waiting_answer.result(30)
        assert aborted.status_code == 200, aborted.text
        assert aborted.json()["meta_info"]["finish_reason"]["type"] == "abort"

        # A DP replica stopped (SIGSTOP: alive, not answering) goes pending, then firing, per
        # replica, while its server's scrapes go on within their interval.
        stopped += _rank_processes(dp.proc.pid)
        assert len(stopped) == 1, stopped
        os.kill(stopped[0], signal.SIGSTOP)

        wait_for(lambda: bool(alerts("PdlifeDPReplicaNotAnswering")), 60,
                 "the stopped replica alerted on")
        (labels,) = alerts("PdlifeDPReplicaNotAnswering")
        assert (labels["job"], labels["dp_rank"]) == (DP_JOB, "1"), labels
        assert prometheus.value(f'up{{job="{DP_JOB}"}}') == 1
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        prometheus.stop()
        decode.stop()
        dp.stop()
        waiting.shutdown()
        prefill.stop()
