"""A prefill server of rank processes (``pdlife serve --tp-size 2``, or ``--dp-size 2``, over
Mooncake) says at its bootstrap endpoint that its KV writes stopped only as it shuts down and
only once every rank confirmed it: each rank process closed its KV manager with its writes
stopped and said so, and exited 0. A decode peer holding pages for a room the prefill never
answered then lets them go at its next health check, not at its release bound; where a rank
cannot confirm (it was killed: it may have been mid-write, and what it handed to its kernel is
still delivered), nothing is said and the decode holds the pages until that bound, with its
WARNING.

The prefill is a real ``pdlife serve`` process with its rank process; the decode is an in-process
service over Mooncake (TCP on loopback) that checks the prefill's health every
:data:`HEARTBEAT_S`. The room the decode holds is one whose prefill half never came: its
destination waits at the prefill ranks, unanswered."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import attrs
import pytest

from kv.mooncake import WritesStopped
from kv.mooncake_engine import LOST_RELEASE_TIMEOUT_S
from scheduler.service.config import ServeConfig
from scheduler.service.engines import _unanswered_of
from tests.service_harness import Server, asgi_client, free_port, model_flags, run, running_service
from tests.test_serve_mesh import MODEL, _rank_processes
from tests.test_writes_stopped import (
    SCHED,
    WAIT_S,
    body,
    decode_config,
    manager_of,
    receiving,
    still_writing,
    until,
    used_pages,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.mooncake]

#: The decode's lost-prefill release bound (s) in the test where it applies: short, so the test
#: is; the test where the prefill says its writes stopped must end well within the default 30 s.
RELEASE_S = 5.0
#: How often (s) the decode checks the prefill's health, each check within as long: the
#: prefill's rank 0 holds the interpreter lock for about a second as it destroys an engine, so
#: its endpoint answers late then.
HEARTBEAT_S = 1.0


def prefill_server(log: Path, port: int, layout: tuple[str, ...] = ("--tp-size", "2")) -> Server:
    return Server(log, "--role", "prefill", "--backend", "mooncake", "--bootstrap-port",
                  str(port), *layout, "--page-size", str(SCHED.page_size),
                  "--pool-pages", "64", "--log-level", "info", *model_flags(MODEL))


def decode(*, release_s: float = LOST_RELEASE_TIMEOUT_S, failures: int = 2) -> ServeConfig:
    """The decode's config: its health checks every :data:`HEARTBEAT_S`, the prefill lost
    after ``failures`` failed in a row, the rooms held for it then for ``release_s``."""
    config = attrs.evolve(decode_config(HEARTBEAT_S), model=MODEL)
    return attrs.evolve(config, mooncake=attrs.evolve(
        config.mooncake, lost_release_timeout_s=release_s, heartbeat_max_failures=failures))


@pytest.mark.parametrize("layout", [("--tp-size", "2"), ("--dp-size", "2")],
                         ids=["tp2", "dp2"])
def test_a_prefill_of_ranks_that_shuts_down_tells_decode_its_writes_stopped(
    layout: tuple[str, ...], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGTERM: the prefill's ranks close their KV managers and confirm, rank 0 says that the
    server's writes stopped and waits for the decode's health check to read it; the decode
    request fails with that reason and its pages come back at once (nothing of a prefill that
    may still write), and the prefill exits 0. At DP 2 the room (odd) is replica 1's: only
    the rank process knows that the decode holds pages for it, and says so to rank 0."""
    port = free_port()
    prefill = prefill_server(tmp_path / "prefill.log", port, layout)

    async def main() -> tuple[float, float]:
        # A shutdown's late answers do not count the prefill lost before it says anything.
        with running_service(decode(failures=5)) as d:
            async with asgi_client(d) as client:
                waiting = asyncio.ensure_future(client.post("/generate", json=body(port, 5)))
                await until(lambda: receiving(d) == 1, "the decode request's destination")
                manager = manager_of(d, port)
                assert used_pages(d) > 0
                started = time.monotonic()
                prefill.signal(signal.SIGTERM)
                r = await asyncio.wait_for(waiting, WAIT_S)
                assert r.status_code >= 500, r.text
                assert "it stopped writing KV" in r.json()["error"]["message"], r.text
                await until(lambda: manager.live_rooms() == 0 and used_pages(d) == 0
                            and d.live_requests() == 0, "the decode pages back")
                freed = time.monotonic() - started
                assert await asyncio.to_thread(prefill.wait, 60) == 0, prefill.tail()
                return freed, time.monotonic() - started

    try:
        prefill.wait_healthy(timeout=180)
        with caplog.at_level(logging.INFO):
            freed, exited = run(main())
    finally:
        prefill.stop()
    log = prefill.log.read_text(errors="replace")
    assert ("told decode peers that this prefill server's KV writes stopped (1 decode ranks "
            "hold pages for rooms it did not answer)") in log, log
    assert "did not check this prefill server's health" not in log, log
    assert still_writing(caplog) == []
    # A health check of the decode's (its interval 1 s), not the 30 s release bound.
    assert freed < 10.0, freed
    logging.getLogger(__name__).info("SIGTERM to decode pages back %.2f s, to exit %.2f s",
                                     freed, exited)


def test_a_prefill_whose_rank_was_killed_never_says_its_writes_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The prefill's rank process is killed while the decode holds a room of the server: the
    server turns unhealthy, and the decode counts it lost and holds the room's pages. On
    SIGTERM the killed rank cannot confirm that its writes stopped, so rank 0 does not say it:
    the decode holds the pages until its release bound (logged at WARNING), not letting them go
    when the prefill shut down, and the prefill exits 1."""
    port = free_port()
    prefill = prefill_server(tmp_path / "prefill.log", port)

    async def main() -> float:
        with running_service(decode(release_s=RELEASE_S)) as d:
            async with asgi_client(d) as client:
                waiting = asyncio.ensure_future(client.post("/generate", json=body(port, 5)))
                await until(lambda: receiving(d) == 1, "the decode request's destination")
                manager = manager_of(d, port)
                (rank,) = _rank_processes(prefill.proc.pid)
                os.kill(rank, signal.SIGKILL)
                r = await asyncio.wait_for(waiting, WAIT_S)  # lost: its health answers 503
                failed = time.monotonic()
                assert r.status_code >= 500, r.text
                assert "it stopped writing KV" not in r.text, r.text
                assert used_pages(d) > 0  # held
                prefill.signal(signal.SIGTERM)
                assert await asyncio.to_thread(prefill.wait, 60) == 1, prefill.tail()
                await until(lambda: manager.live_rooms() == 0 and used_pages(d) == 0,
                            "the decode pages back at the release bound")
                return time.monotonic() - failed

    try:
        prefill.wait_healthy(timeout=180)
        with caplog.at_level(logging.INFO):
            held = run(main())
    finally:
        prefill.stop()
    assert still_writing(caplog), "the decode held the pages of a prefill that may still write"
    assert not [r.getMessage() for r in caplog.records if "it stopped writing KV" in r.getMessage()]
    assert held > RELEASE_S - 1.0, held  # the bound, not the prefill's shutdown, let them go
    log = prefill.log.read_text(errors="replace")
    assert ("decode peers are not told that this prefill server's KV writes stopped: rank "
            "processes did not confirm that theirs stopped: dp0/rank1") in log, log
    assert "ended by signal 9" in log, log
    assert "told decode peers that" not in log, log


def test_the_sessions_to_wait_for_are_every_ranks_with_the_longest_interval() -> None:
    """Rank 0 waits for every decode session any rank left unanswered, as long as the slowest
    interval any rank knows for it, and for the cap where any rank knows none (0)."""
    words = [WritesStopped(0, {"a:1": 1.0, "b:1": 5.0}),
             WritesStopped(1, {"a:1": 2.0, "b:1": 0.0, "c:1": 3.0}),
             WritesStopped(2, {"b:1": 4.0})]
    assert _unanswered_of(words) == {"a:1": 2.0, "b:1": 0.0, "c:1": 3.0}
    assert _unanswered_of([WritesStopped(0, {})]) == {}
