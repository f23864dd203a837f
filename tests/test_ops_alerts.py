"""The alert expressions of docs/prometheus-alerts.yml against series written by hand, with
Prometheus' own evaluator (``promtool test rules``, Debian's prometheus ships it): what an alert
leaves out (a planned drain) does not fire it, what it counts does. tests/test_prometheus.py
checks the same rules against real workers' scrapes.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler.decode.metrics import PREFILL_DRAINING
from tests.service_harness import ROOT

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
DECODE = {"job": "pdlife-decode", "instance": "127.0.0.1:30001"}


def alert(name: str) -> dict[str, Any]:
    """Alert ``name`` of docs/prometheus-alerts.yml, its annotations left out (the tests below
    are about when it fires, not what its summary says)."""
    rules = yaml.safe_load((ROOT / "docs" / "prometheus-alerts.yml").read_text())
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r["alert"] == name]
    return {k: v for k, v in rule.items() if k != "annotations"}


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    shown = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{shown}}}", "values": values}


def fires(tmp_path: Path, name: str, input_series: list[dict[str, str]],
          expected: list[dict[str, str]], at: str = "20m") -> None:
    """Alert ``name``, evaluated every minute over ``input_series`` (a sample a minute), fires
    at ``at`` with exactly the labels in ``expected`` (none: it does not fire)."""
    assert Path(PROMTOOL).exists(), "install Debian's prometheus (make system-deps)"
    rule = alert(name)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(
        {"groups": [{"name": "pdlife", "rules": [rule]}]}, sort_keys=False))
    test = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": input_series,
            "alert_rule_test": [{
                "eval_time": at, "alertname": name,
                "exp_alerts": [{"exp_labels": {**rule.get("labels", {}), **labels}}
                               for labels in expected],
            }],
        }],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    run = subprocess.run([PROMTOOL, "test", "rules", "test.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def decode_finished(reason: str, per_minute: int) -> dict[str, str]:
    state = "done" if reason == "" else "failed"
    return series("pdlife_decode_requests_finished_total",
                  {**DECODE, "state": state, "reason": reason}, f"0+{per_minute}x30")


@pytest.mark.parametrize("reason", ["aborted", PREFILL_DRAINING])
def test_decode_requests_failing_leaves_out_aborts_and_a_prefill_that_drains(
    tmp_path: Path, reason: str
) -> None:
    """A third of the decode requests fail, all for a reason the alert leaves out: silent."""
    fires(tmp_path, "PdlifeDecodeRequestsFailing",
          [decode_finished("", 20), decode_finished(reason, 10)], [])


@pytest.mark.parametrize("reason", ["bootstrap_failed", "transfer_failed"])
def test_decode_requests_failing_fires_for_other_failures(tmp_path: Path, reason: str) -> None:
    """As many fail for a reason it counts (a prefill that refuses rooms for another cause than
    a drain among them): it fires, once, for the worker."""
    fires(tmp_path, "PdlifeDecodeRequestsFailing",
          [decode_finished("", 20), decode_finished(PREFILL_DRAINING, 10),
           decode_finished(reason, 10)], [DECODE])


PREFILL = {"job": "pdlife-prefill", "instance": "127.0.0.1:30000"}


def prefill_waiting(bootstrapped_per_minute: int, probes_per_minute: int) -> list[dict[str, str]]:
    """A prefill whose one request waits for its destination the whole time, while
    ``bootstrapped_per_minute`` requests bootstrap, ``probes_per_minute`` of them probes."""
    return [
        series("pdlife_requests", {**PREFILL, "state": "bootstrapping"}, "1x30"),
        series("pdlife_transitions_total", {**PREFILL, "event": "bootstrapped"},
               f"0+{bootstrapped_per_minute}x30"),
        series("pdlife_probe_bootstraps_total", PREFILL, f"0+{probes_per_minute}x30"),
    ]


def test_requests_waiting_for_decode_is_not_hidden_by_probes(tmp_path: Path) -> None:
    """Only /health_generate probes bootstrap (on the fake host, with no decode): it fires."""
    fires(tmp_path, "PdlifeRequestsWaitingForDecode", prefill_waiting(4, 4), [PREFILL])


def test_requests_waiting_for_decode_is_silent_while_real_requests_bootstrap(
    tmp_path: Path
) -> None:
    """One real request a minute bootstraps beside the probes: a decode sends destinations."""
    fires(tmp_path, "PdlifeRequestsWaitingForDecode", prefill_waiting(5, 4), [])
