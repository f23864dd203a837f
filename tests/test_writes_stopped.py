"""A prefill server says at its bootstrap endpoint that its KV writes stopped exactly when they
have: as it shuts down, and once its failed engine's KV manager closed, where it is the one rank
behind the endpoint and every transfer worker ended with no write in flight. A decode peer that
holds pages for a room the prefill never answered then lets them go at its next health check,
not at its release bound (30 s); a prefill whose write does not conclude never says it.

Both servers are real in-process services over Mooncake (TCP on loopback); the decode ranks
check the prefill's health every :data:`HEARTBEAT_S`. The room the decode holds is one whose
prefill half never came (the router's other half queued, then aborted by a drain): its
destination waits at the prefill rank, unanswered."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest

import kv.mooncake
from kv.bootstrap import BootstrapClient
from kv.mooncake_decode import MooncakeDecodeManager
from kv.mooncake_engine import MooncakeConfig, MooncakeEngine
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.config import ServeConfig
from scheduler.service.core import Service
from tests.service_harness import asgi_client, free_port, run, running_service

pytestmark = pytest.mark.mooncake

MODEL = ModelConfig.tiny()
SCHED = SchedulerConfig(page_size=4)
#: How often (s) the decode ranks check the prefill's health (5 s by default).
HEARTBEAT_S = 0.2
#: How long a test waits for what it expects.
WAIT_S = 10.0


def prefill_config(port: int) -> ServeConfig:
    return ServeConfig(role="prefill", backend="mooncake", model=MODEL, scheduler=SCHED,
                       pool_pages=64, metadata_slots=8, bootstrap_port=port)


def decode_config(heartbeat_s: float = HEARTBEAT_S) -> ServeConfig:
    return ServeConfig(role="decode", backend="mooncake", model=MODEL, scheduler=SCHED,
                       pool_pages=16, metadata_slots=8,
                       mooncake=MooncakeConfig(heartbeat_interval_s=heartbeat_s,
                                               connect_timeout_s=WAIT_S))


def body(port: int, room: int) -> dict[str, Any]:
    return {"rid": f"r{room}", "input_ids": [1, 2, 3], "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port, "bootstrap_room": room}


async def until(condition: Any, what: str, timeout: float = WAIT_S) -> None:
    """Wait, without blocking the event loop, until ``condition()`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.01)


def receiving(decode: Service) -> int:
    """Decode requests that sent their destination and wait for their KV."""
    return int(decode.snapshot.get("requests", {}).get("decode", {}).get("receiving", 0))


def used_pages(decode: Service) -> int:
    return int(decode.snapshot["kv_pool"]["decode"]["used_pages"])


def manager_of(decode: Service, port: int) -> MooncakeDecodeManager:
    router = decode.decode_kv
    assert router is not None
    [manager] = [m for m in router.managers()
                 if getattr(m, "bootstrap_addr", None) == f"127.0.0.1:{port}"]
    assert isinstance(manager, MooncakeDecodeManager)
    return manager


def still_writing(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What decode logged of pages held for a prefill that may still write into them."""
    return [r.getMessage() for r in caplog.records if r.name == "kv.mooncake_decode"
            and ("still writing" in r.getMessage() or "held until" in r.getMessage())]


@pytest.mark.parametrize("how", ["shutdown", "engine-failure"])
def test_decode_lets_the_pages_of_an_unanswered_room_go_once_the_prefill_stopped_writing(
    how: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The prefill shuts down (after its drain, as ``pdlife serve`` closes it), or its engine
    fails, while a decode request's destination waits there unanswered: its endpoint says that
    its writes stopped, the decode's next health check reads it, and the request fails with
    that reason, its pages back at once: no room held for the 30 s bound, nothing logged of a
    prefill that may still write. The shutdown waits for that health check, not longer."""
    port = free_port()
    prefill = Service(prefill_config(port))
    prefill.start_loop()

    async def main() -> float:
        took = 0.0
        with running_service(decode_config()) as decode:
            async with asgi_client(decode) as d:
                waiting = asyncio.ensure_future(d.post("/generate", json=body(port, 5)))
                await until(lambda: receiving(decode) == 1, "the decode request's destination")
                manager = manager_of(decode, port)
                assert used_pages(decode) > 0
                if how == "shutdown":
                    started = time.monotonic()
                    await asyncio.to_thread(prefill.close)
                    took = time.monotonic() - started
                else:
                    prefill.loop.fail(RuntimeError("boom"))
                r = await asyncio.wait_for(waiting, WAIT_S)
                assert r.status_code >= 500, r.text
                assert "it stopped writing KV" in r.json()["error"]["message"], r.text
                await until(lambda: manager.live_rooms() == 0 and used_pages(decode) == 0
                            and decode.live_requests() == 0, "the decode pages back")
                assert manager.lost is not None
        return took

    with caplog.at_level(logging.INFO):
        try:
            took = run(main())
        finally:
            prefill.close()
    assert prefill.bootstrap is not None and prefill.bootstrap.writes_stopped
    assert still_writing(caplog) == []
    told = [r.getMessage() for r in caplog.records if r.name == "scheduler.service.engines"]
    assert told == ["told decode peers that this prefill server's KV writes stopped (1 decode "
                    "ranks hold pages for rooms it did not answer)"], told
    assert took < 5.0  # one health check of the decode's (its interval 0.2 s), not the bound


def test_a_shutdown_that_left_no_room_unanswered_waits_for_no_decode_peer() -> None:
    """A decode rank registered with the prefill but holding none of its rooms (its health
    check is an hour away): the prefill still says its writes stopped, but closes without
    waiting for anyone to read it."""
    port = free_port()
    prefill = Service(prefill_config(port))
    prefill.start_loop()

    async def main() -> float:
        with running_service(decode_config(heartbeat_s=3600)) as decode:
            async with asgi_client(decode) as d, asgi_client(prefill) as p:
                answers = await asyncio.wait_for(asyncio.gather(
                    p.post("/generate", json=body(port, 7)),
                    d.post("/generate", json=body(port, 7))), WAIT_S)
                assert [a.status_code for a in answers] == [200, 200], answers[1].text
                await until(lambda: used_pages(decode) == 0, "the decode request ended")
                assert prefill.prefill is not None
                kv_manager = prefill.prefill.kv
                assert isinstance(kv_manager, kv.mooncake.MooncakeKVManager)
                assert kv_manager.decode_sessions() == [manager_of(decode, port).session]
                started = time.monotonic()
                await asyncio.to_thread(prefill.close)
                took = time.monotonic() - started
                assert kv_manager.writes_stopped is not None
                assert kv_manager.writes_stopped.unanswered == {}
                return took

    try:
        took = run(main())
    finally:
        prefill.close()
    assert prefill.bootstrap is not None and prefill.bootstrap.writes_stopped
    assert took < 3.0  # the wait would have been 10 s (the cap): the decode never checks


def test_a_prefill_whose_write_does_not_conclude_never_says_its_writes_stopped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The prefill's engine fails while a transfer worker waits on a write that does not
    conclude (a hung transport): the worker does not end when the KV manager closes, so the
    endpoint says the server is unhealthy but not that its writes stopped, and decode holds
    the room's pages (its release bound lets them go), as before."""
    entered, release = threading.Event(), threading.Event()
    real_wait = MooncakeEngine.wait

    def hung(engine: MooncakeEngine, batch: int) -> int:
        entered.set()
        release.wait(4 * WAIT_S)
        return real_wait(engine, batch)

    monkeypatch.setattr(MooncakeEngine, "wait", hung)
    monkeypatch.setattr(kv.mooncake, "WORKERS_STOP_S", 0.2)
    port = free_port()
    prefill = Service(prefill_config(port))
    prefill.start_loop()

    async def main() -> None:
        with running_service(decode_config()) as decode:
            async with asgi_client(decode) as d, asgi_client(prefill) as p:
                halves = asyncio.gather(p.post("/generate", json=body(port, 6)),
                                        d.post("/generate", json=body(port, 6)))
                assert await asyncio.to_thread(entered.wait, WAIT_S), "no write started"
                manager = manager_of(decode, port)
                prefill.loop.fail(RuntimeError("boom"))
                await until(lambda: any("not told" in r.getMessage() for r in caplog.records),
                            "the failed prefill's KV manager closed")
                assert prefill.bootstrap is not None
                assert not prefill.bootstrap.writes_stopped
                # A 503 that says nothing of the writes: no PrefillStopped.
                assert BootstrapClient(prefill.bootstrap.address).instance() is None
                answers = await asyncio.wait_for(halves, WAIT_S)
                assert [a.status_code >= 500 for a in answers] == [True, True]
                await until(lambda: manager.lost is not None and decode.live_requests() == 0,
                            "decode counted the prefill lost")
                assert "it stopped writing KV" not in (manager.lost or "")
                assert manager.live_rooms() == 1 and used_pages(decode) > 0  # held

    with caplog.at_level(logging.INFO):
        try:
            run(main())
        finally:
            release.set()
            prefill.close()
    assert prefill.bootstrap is not None and not prefill.bootstrap.writes_stopped
    assert any("transfer worker still running" in r.getMessage() for r in caplog.records)
