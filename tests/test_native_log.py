"""The transfer engine's start-up lines: harmless ones go to DEBUG, real ones keep their level,
and nothing else written to standard error meanwhile is lost. Read from the logging records of
a real engine start, and from a ``pdlife serve`` worker's log."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from kv.mooncake_engine import MooncakeConfig, MooncakeEngine
from kv.native_log import HARMLESS, HARMLESS_ON_TCP, relog
from tests.service_harness import Server

LOG = logging.getLogger("tests.native_log")
DESCRIPTOR = ("E1130 19:37:19.390807 14374 transfer_metadata.cpp:1098] Local segment descriptor "
              "not found")
NO_RDMA = "W1130 19:37:19.390765 14374 topology.cpp:201] No RDMA devices found, check your device"


def _records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOG.name]


def test_harmless_lines_go_to_debug_and_real_ones_keep_their_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, LOG.name)
    other = io.BytesIO()
    relog([
        "WARNING: Logging before InitGoogleLogging() is written to STDERR",
        DESCRIPTOR,
        NO_RDMA,
        "E1130 19:37:19.400000 14374 tcp_transport.cpp:77] Failed to bind port 15360",
        "F1130 19:37:19.400001 14374 engine.cpp:1] fatal",
        "I1130 19:37:19.400002 14374 engine.cpp:2] started",
        "a line another thread wrote",
        "",
    ], LOG, other, HARMLESS_ON_TCP)
    records = _records(caplog)
    assert [level for level, _ in records] == [
        logging.DEBUG, logging.DEBUG, logging.DEBUG, logging.ERROR, logging.CRITICAL,
        logging.INFO,
    ]
    assert "Local segment descriptor not found (harmless: " in records[1][1]
    assert records[3][1] == "mooncake tcp_transport.cpp:77] Failed to bind port 15360"
    assert other.getvalue() == b"a line another thread wrote\n"


def test_missing_rdma_devices_stay_a_warning_when_rdma_was_asked_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, LOG.name)
    relog([NO_RDMA, DESCRIPTOR], LOG, io.BytesIO(), HARMLESS)
    assert [level for level, _ in _records(caplog)] == [logging.WARNING, logging.DEBUG]


@pytest.mark.mooncake
def test_a_real_engine_start_is_caught_and_relogged(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG, "kv.mooncake_engine")
    engine = MooncakeEngine(MooncakeConfig())
    try:
        assert engine.session.startswith("127.0.0.1:")
    finally:
        engine.close()
    caught = [(r.levelno, r.getMessage()) for r in caplog.records
              if r.name == "kv.mooncake_engine"]
    assert any(level == logging.DEBUG and "Local segment descriptor not found (harmless" in m
               for level, m in caught), caught
    err = capfd.readouterr().err
    assert "Local segment descriptor not found" not in err
    assert "Logging before InitGoogleLogging" not in err


@pytest.mark.mooncake
def test_a_second_engine_in_the_process_keeps_the_allocator_quietly(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG, "kv.mooncake_engine")
    engines = [MooncakeEngine(MooncakeConfig()) for _ in range(2)]
    for engine in engines:
        engine.close()
    assert any(r.levelno == logging.DEBUG
               and "Memory allocator already initialized with: tcp (harmless" in r.getMessage()
               for r in caplog.records if r.name == "kv.mooncake_engine")
    assert "Memory allocator already initialized" not in capfd.readouterr().err


@pytest.mark.mooncake
@pytest.mark.multiprocess
def test_a_worker_starts_with_a_quiet_log(tmp_path: Path) -> None:
    quiet = Server(tmp_path / "quiet.log", "--role", "prefill", "--backend", "mooncake",
                   "--bootstrap-port", "0")
    verbose = Server(tmp_path / "debug.log", "--role", "prefill", "--backend", "mooncake",
                     "--bootstrap-port", "0", "--log-level", "debug")
    try:
        quiet.wait_healthy()
        verbose.wait_healthy()
        log = quiet.tail(100_000)
        assert "Uvicorn running" in log
        assert "Local segment descriptor" not in log and "InitGoogleLogging" not in log
        # The one warning a loopback worker over Mooncake gives: the engine's own listeners
        # cannot be bound to loopback (docs/security.md); said once, nothing else.
        warnings = [line for line in log.splitlines() if " WARNING " in line]
        assert len(warnings) == 1 and " WARNING kv.listeners: " in warnings[0], warnings
        assert " ERROR " not in log
        debug = verbose.tail(100_000)
        assert "DEBUG kv.mooncake_engine: mooncake transfer_metadata.cpp:" in debug
        assert "Local segment descriptor not found (harmless: " in debug
    finally:
        quiet.stop()
        verbose.stop()
