"""A real Prometheus (Debian's ``prometheus``) scrapes a ``pdlife serve`` prefill and decode pair
over Mooncake, with the scrape config docs/operations.md ships; after some traffic the test
reads back, through Prometheus' query API, requests finished by reason, a TTFT phase quantile,
KV bytes sent and pool usage, and every query of docs/grafana-dashboard.json returns series.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from scheduler.model.reference import ModelConfig
from tests.service_harness import ROOT, Process, Server, free_port, wait_for

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


def scrape_config(prefill: str, decode: str) -> str:
    """docs/operations.md's prometheus.yml, scraping ``prefill`` and ``decode`` every second."""
    doc = (ROOT / "docs" / "operations.md").read_text()
    match = re.search(r"```yaml\n# prometheus.yml\n(.*?)```", doc, re.DOTALL)
    assert match, "docs/operations.md has no prometheus.yml block"
    text = match.group(1)
    for default, target in (("127.0.0.1:30000", prefill), ("127.0.0.1:30001", decode)):
        assert default in text
        text = text.replace(default, target)
    return text.replace("scrape_interval: 5s", "scrape_interval: 1s").replace(
        "evaluation_interval: 15s", "evaluation_interval: 1s")


def alert_rules() -> list[dict[str, Any]]:
    """The rules of docs/prometheus-alerts.yml (``promtool check rules`` accepts them)."""
    path = ROOT / "docs" / "prometheus-alerts.yml"
    check = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    rules: list[dict[str, Any]] = [
        r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]
    return rules


def dashboard_queries(job: str | None = None) -> list[str]:
    """Every panel's query as Grafana sends it with ``job`` chosen in the dashboard's job
    variable (None: "All", the variable's ``allValue``)."""
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "job"]
    chosen = variable["allValue"] if job is None else job
    return [t["expr"].replace("$job", chosen) for p in dashboard["panels"] for t in p["targets"]]


class Prometheus(Process):
    def __init__(self, tmp: Path, config: str) -> None:
        (tmp / "prometheus.yml").write_text(config)
        shutil.copy(ROOT / "docs" / "prometheus-alerts.yml", tmp)
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
    bootstrap_port = free_port()
    prefill = Server(tmp_path / "prefill.log", "--role", "prefill", "--bootstrap-port",
                     str(bootstrap_port), "--bootstrap-timeout", "1", *COMMON)
    decode = Server(tmp_path / "decode.log", "--role", "decode", *COMMON)
    prometheus = Prometheus(tmp_path, scrape_config(prefill.url.removeprefix("http://"),
                                                    decode.url.removeprefix("http://")))
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        wait_for(prometheus.ready, 60, "prometheus ready")
        wait_for(lambda: len(prometheus.query('up{job=~"pdlife-.*"} == 1')) == 2, 30,
                 "both workers scraped")

        def body(room: int, n: int) -> dict[str, Any]:
            return {"input_ids": [(7 * room + k) % 250 + 1 for k in range(n)],
                    "rid": f"r{room}", "sampling_params": {"max_new_tokens": 3,
                                                           "ignore_eos": True},
                    "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
                    "bootstrap_room": room}

        def post(url: str, b: dict[str, Any]) -> int:
            return httpx.post(f"{url}/generate", json=b, timeout=60).status_code

        with ThreadPoolExecutor(2 * PAIRS + 1) as pool:
            calls = [pool.submit(post, server.url, body(room, 40))
                     for room in range(1, PAIRS + 1) for server in (prefill, decode)]
            # No decode server asks for this room: prefill times its bootstrap out.
            orphan = pool.submit(post, prefill.url, body(PAIRS + 1, 20))
            assert [c.result() for c in calls] == [200] * (2 * PAIRS)
            assert orphan.result() == 500

        queries = dashboard_queries()

        def scraped() -> bool:
            total = prometheus.query("sum(pdlife_requests_finished_total)")
            return (bool(total) and float(total[0]["value"][1]) == PAIRS + 1
                    and all(prometheus.query(q) for q in queries))

        wait_for(scraped, 60, "the traffic scraped and every dashboard query answered")
        # The job variable lists both workers, and choosing one keeps the other's series out.
        jobs = httpx.get(f"{prometheus.url}/api/v1/label/job/values",
                         params={"match[]": 'up{job=~"pdlife-.*"}'}, timeout=10).json()["data"]
        assert sorted(jobs) == ["pdlife-decode", "pdlife-prefill"]
        for job in jobs:
            found = {s["metric"]["job"] for q in dashboard_queries(job)
                     for s in prometheus.query(q) if "job" in s["metric"]}
            assert found == {job}, (job, found)

        # Every outcome is exported from the start, at 0 until it happens.
        finished = {(s["metric"]["state"], s["metric"].get("reason", "")): float(s["value"][1])
                    for s in prometheus.query("pdlife_requests_finished_total")
                    if float(s["value"][1])}
        # Prometheus drops empty labels: a request that finished well has no reason.
        assert finished == {("done", ""): PAIRS, ("failed", "bootstrap_timeout"): 1}
        assert prometheus.value('pdlife_decode_requests_finished_total{state="done"}') == PAIRS
        for phase in ("bootstrap_wait", "queue_wait", "forward", "transfer"):
            p99 = prometheus.value(
                "histogram_quantile(0.99, sum by (le) (rate("
                f'pdlife_ttft_phase_seconds_bucket{{phase="{phase}"}}[1m])))')
            assert math.isfinite(p99) and p99 > 0, phase
        assert prometheus.value('pdlife_ttft_phase_seconds_count{phase="transfer"}') == PAIRS
        assert prometheus.value('pdlife_transfer_bytes_total{job="pdlife-prefill"}') > 0
        assert prometheus.value("pdlife_kv_pool_pages") == POOL_PAGES
        # A prefill worker exports the decode gauges too, at 0.
        assert prometheus.value('pdlife_decode_kv_pool_pages{job="pdlife-decode"}') == POOL_PAGES
        assert 0 <= prometheus.value("pdlife_kv_usage_ratio") <= 1

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
    finally:
        prometheus.stop()
        decode.stop()
        prefill.stop()
