"""``--log-level`` and ``--log-format``: one configuration for a worker's HTTP process and its
rank processes (:mod:`scheduler.service.logs`).

In a fresh interpreter, ``json`` writes one object per line with the documented keys (a
traceback under ``exception``, a rank process's name under ``process``), warnings and uncaught
exceptions included, and ``text`` names the process in each line. A prefill of two DP replicas
with the delayer writes only JSON lines, the second replica's among them under its own name; at
``--log-level warning`` none of its processes logs at INFO (the rank processes used to log at
INFO whatever the flag said).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.model.reference import ModelConfig
from tests.service_harness import Server, model_flags

MODEL = ModelConfig(hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                    max_position=256, seed=9)
PROMPTS = [[(5 * i + 2 * j + 1) % 250 for j in range(3 + 7 * i)] for i in range(4)]
OUTCOMES = "prefill delayer outcomes of replica"

_LOG_SOME = """
import logging, sys
from scheduler.service.logs import LogSettings, configure
configure(LogSettings(sys.argv[1], sys.argv[2]), process=sys.argv[3] or None)
log = logging.getLogger("pdlife.test")
log.debug("not shown")
log.info("room %d: ünïcode", 7)
try:
    1 / 0
except ZeroDivisionError:
    log.exception("it failed")
"""


def _log_some(level: str, fmt: str, process: str = "") -> list[str]:
    done = subprocess.run([sys.executable, "-c", _LOG_SOME, level, fmt, process],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == ""
    return done.stderr.splitlines()


def test_json_is_one_object_per_record_with_the_documented_keys() -> None:
    lines = _log_some("info", "json", "dp1/rank0")
    info, failed = (json.loads(line) for line in lines)  # the traceback inside its object
    assert set(info) == {"time", "level", "logger", "message", "process"}
    assert (info["level"], info["logger"], info["message"], info["process"]) == (
        "INFO", "pdlife.test", "room 7: ünïcode", "dp1/rank0")
    assert info["time"].endswith("Z") and len(info["time"]) == len("2026-01-01T00:00:00.000Z")
    assert (failed["level"], failed["message"]) == ("ERROR", "it failed")
    assert failed["exception"].startswith("Traceback (most recent call last):")
    assert failed["exception"].endswith("ZeroDivisionError: division by zero")
    # The HTTP process has no process name.
    assert "process" not in json.loads(_log_some("warning", "json")[0])


_FAIL_UNCAUGHT = """
import threading, warnings
from scheduler.service.logs import LogSettings, configure
configure(LogSettings("info", "json"))
warnings.warn("an old API")
worker = threading.Thread(target=lambda: 1 / 0, name="worker-1")
worker.start()
worker.join()
raise KeyError("at the top")
"""


def test_json_takes_warnings_and_uncaught_exceptions_too() -> None:
    """Nothing of the process's own reaches standard error as plain text: a warning, a
    thread's uncaught exception and the main thread's are JSON records as well."""
    done = subprocess.run([sys.executable, "-c", _FAIL_UNCAUGHT], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    warned, in_thread, at_top = (json.loads(line) for line in done.stderr.splitlines())
    assert (warned["logger"], warned["level"]) == ("py.warnings", "WARNING")
    assert "UserWarning: an old API" in warned["message"]
    assert (in_thread["logger"], in_thread["level"], in_thread["message"]) == (
        "pdlife.uncaught", "CRITICAL", "uncaught ZeroDivisionError in thread worker-1")
    assert in_thread["exception"].endswith("ZeroDivisionError: division by zero")
    assert (at_top["message"], at_top["exception"].splitlines()[-1]) == (
        "uncaught KeyError", "KeyError: 'at the top'")


def test_text_names_the_process_and_the_level_filters() -> None:
    lines = _log_some("error", "text", "decode/rank2")
    assert " ERROR decode/rank2 pdlife.test: it failed" in lines[0], lines
    assert lines[-1] == "ZeroDivisionError: division by zero"
    assert not any("room 7" in line for line in lines)
    assert " INFO pdlife.test: room 7: ünïcode" in _log_some("info", "text")[0]


def _serve(tmp_path: Path, *flags: str) -> str:
    """The log of a prefill of two DP replicas with the delayer that answered a batch and
    stopped on SIGTERM."""
    server = Server(tmp_path / "serve.log", "--role", "prefill", "--backend", "fake",
                    *model_flags(MODEL), "--page-size", "4", "--dp-size", "2",
                    "--enable-prefill-delayer", *flags)
    try:
        server.wait_healthy(timeout=180)
        server.answers_as_colocated(MODEL, PROMPTS)
        tail = server.tail()
        assert server.stop(timeout=60) == 0, tail
    finally:
        server.stop()
    return server.log.read_text()


@pytest.mark.multiprocess
def test_every_process_of_a_worker_writes_json(tmp_path: Path) -> None:
    lines = _serve(tmp_path, "--log-format", "json", "--log-level", "info").splitlines()
    records = [json.loads(line) for line in lines]  # every line, the rank process's too
    outcomes = {r.get("process"): r["level"] for r in records if OUTCOMES in r["message"]}
    assert outcomes == {None: "INFO", "dp1/rank0": "INFO"}, lines[-20:]
    assert any(r["logger"] == "scheduler.cli.serve" and r["message"] == "drained; shutting down"
               for r in records), lines[-20:]


@pytest.mark.multiprocess
def test_the_rank_processes_log_at_the_workers_level(tmp_path: Path) -> None:
    log = _serve(tmp_path, "--log-level", "warning")
    assert OUTCOMES not in log, log[-4000:]
    assert " INFO " not in log, log[-4000:]
