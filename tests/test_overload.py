"""``--max-queued-requests``: beyond the bound a request is refused at once with 503
``overloaded`` and ``Retry-After``, registers nothing and tells its peer; the bootstrap wait
counts toward the bound. The queue is driven to its bound deterministically: a prefill server
with no decode peer keeps every request in BOOTSTRAPPING until it is aborted."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from hypothesis import given
from hypothesis import strategies as st

from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.core import ServeConfig
from scheduler.service.shedding import Overloaded, QueueBound
from tests.service_harness import asgi_client, free_port, idle, run, running_service

MODEL = ModelConfig.tiny(seed=3)
LIMIT = 3
WAIT_POLLS = 4000


def prefill_config(limit: int | None = LIMIT) -> ServeConfig:
    return ServeConfig(role="prefill", backend="mooncake", model=MODEL,
                       scheduler=SchedulerConfig(page_size=4, bootstrap_timeout=600),
                       pool_pages=64, metadata_slots=8, bootstrap_port=free_port(),
                       max_queued_requests=limit)


def body(rid: str, room: int) -> dict[str, Any]:
    return {"input_ids": [5, 6, 7], "rid": rid, "sampling_params": {"max_new_tokens": 1},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": 9, "bootstrap_room": room}


def metric(text: str, prefix: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


async def until(client: httpx.AsyncClient, what: str, check: Any) -> dict[str, Any]:
    """``/server_info`` once ``check`` holds for it (polled, bounded)."""
    for _ in range(WAIT_POLLS):
        info: dict[str, Any] = (await client.get("/server_info")).json()
        if check(info):
            return info
        await asyncio.sleep(0.005)
    raise AssertionError(f"{what}: never; last /server_info {info}")


def bootstrapping(n: int) -> Any:
    return lambda info: (info["live_requests"] == n
                         and info["requests"]["prefill"].get("bootstrapping") == n)


def test_a_full_queue_refuses_at_once_and_keeps_nothing() -> None:
    async def main() -> None:
        with running_service(prefill_config()) as service:
            async with asgi_client(service) as client:
                waiting = [asyncio.ensure_future(client.post("/generate", json=body(f"q{i}", i)))
                           for i in range(1, LIMIT + 1)]
                await until(client, "the queue full", bootstrapping(LIMIT))
                before = (await client.get("/metrics")).text

                r = await client.post("/generate", json=body("over", 100))
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "1"
                error = r.json()["error"]
                assert error["type"] == "overloaded" and error["rid"] == "over"
                assert "--max-queued-requests" in error["message"]
                # A batch is refused whole: its first prompt is not left behind.
                batch = {**body("batch", 0), "input_ids": [[1, 2], [3, 4]],
                         "bootstrap_room": [101, 102]}
                r = await client.post("/generate", json=batch)
                assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded"
                info = await until(client, "still full", bootstrapping(LIMIT))
                assert info["kv_pool"]["prefill"]["used_pages"] == 0
                # Overload is not ill health: the router keeps the worker.
                assert (await client.get("/health")).status_code == 200
                after = (await client.get("/metrics")).text
                overloaded = 'pdlife_http_rejected_total{reason="overloaded"}'
                assert metric(after, overloaded) - metric(before, overloaded) == 2
                status = 'pdlife_http_requests_total{method="POST",route="/generate",status="503"}'
                assert metric(after, status) - metric(before, status) == 2

                # A freed place is taken again at once.
                assert (await client.post("/abort_request", json={"rid": "q1"})).status_code == 200
                answer = await waiting[0]
                assert answer.json()["meta_info"]["finish_reason"]["type"] == "abort"
                await until(client, "one place free", bootstrapping(LIMIT - 1))
                waiting[0] = asyncio.ensure_future(client.post("/generate", json=body("q4", 4)))
                await until(client, "full again", bootstrapping(LIMIT))
                assert (await client.post("/generate", json=body("over2", 103))).status_code == 503

                assert (await client.post("/abort_request", json={"abort_all": True})
                        ).json()["aborted"] == LIMIT
                for call in waiting:
                    assert (await call).json()["meta_info"]["finish_reason"]["type"] == "abort"
                await until(client, "idle", idle)

    run(main())


def test_the_refused_rooms_are_told_to_the_decode_peer() -> None:
    """A refusal for overload is a refusal like any other (invariant 8): the prefill records
    the room, so decode's destination for it is answered with ``overloaded`` at once."""

    async def main() -> None:
        with running_service(prefill_config(limit=1)) as service:
            async with asgi_client(service) as client:
                first = asyncio.ensure_future(client.post("/generate", json=body("q", 1)))
                await until(client, "the queue full", bootstrapping(1))
                before = (await client.get("/metrics")).text
                assert (await client.post("/generate", json=body("over", 55))).status_code == 503
                sent = 'pdlife_peer_refusals_total{direction="sent"}'
                for _ in range(WAIT_POLLS):
                    after = (await client.get("/metrics")).text
                    if metric(after, sent) > metric(before, sent):
                        break
                    await asyncio.sleep(0.005)
                else:
                    raise AssertionError("the overloaded room was never refused to decode")
                await client.post("/abort_request", json={"abort_all": True})
                await first

    run(main())


def test_without_a_bound_nothing_is_refused() -> None:
    async def main() -> None:
        with running_service(prefill_config(limit=None)) as service:
            async with asgi_client(service) as client:
                calls = [asyncio.ensure_future(client.post("/generate", json=body(f"q{i}", i)))
                         for i in range(1, 2 * LIMIT + 1)]
                await until(client, "all admitted", bootstrapping(2 * LIMIT))
                await client.post("/abort_request", json={"abort_all": True})
                for call in calls:
                    assert (await call).status_code == 200

    run(main())


def test_health_generate_under_overload_is_503() -> None:
    """The warm-up request counts like any other: a full queue answers the probe 503."""

    async def main() -> None:
        with running_service(prefill_config(limit=1)) as service:
            async with asgi_client(service) as client:
                first = asyncio.ensure_future(client.post("/generate", json=body("q", 1)))
                await until(client, "the queue full", bootstrapping(1))
                r = await client.get("/health_generate")
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                await client.post("/abort_request", json={"abort_all": True})
                await first

    run(main())


# -- the bound's arithmetic, against a model of requests ----------------------------------------

ops = st.lists(st.sampled_from(["admit", "start", "end_queued", "end_running", "publish"]),
               max_size=200)


@given(ops, st.integers(1, 5))
def test_the_bound_holds_whenever_the_counts_are_published(script: list[str], limit: int
                                                           ) -> None:
    """Requests are admitted, start (take pages), end, and the engines' counts are published at
    arbitrary moments, as passes lag the HTTP side: the true number of queued requests never
    exceeds the limit, and with everything published the estimate is exact."""
    bound = QueueBound(limit)
    queued = running = 0
    for op in script:
        if op == "admit":
            try:
                bound.check(queued + running, "r")
            except Overloaded:
                assert bound.queued(queued + running) >= limit
                continue
            queued += 1
        elif op == "start" and queued:
            queued, running = queued - 1, running + 1
        elif op == "end_queued" and queued:
            queued -= 1
            bound.ended()
        elif op == "end_running" and running:
            running -= 1
            bound.ended()
        elif op == "publish":
            bound.published({"prefill": {"bootstrapping": queued, "forward": running}})
            assert bound.queued(queued + running) == queued
        assert queued <= limit
        assert bound.queued(queued + running) >= queued


replica_ops = st.lists(st.tuples(st.sampled_from(["admit", "start", "end_queued", "end_running",
                                                   "publish", "publish_all"]),
                                  st.integers(0, 2)), max_size=200)


@given(replica_ops, st.integers(1, 5))
def test_the_bound_counts_what_runs_on_every_dp_replica(script: list[tuple[str, int]],
                                                       limit: int) -> None:
    """A prefill server of three DP replicas registers every request; the other replicas
    publish their own counts of requests holding pages, and the requests of each that ended
    since are paired with its count: the bound holds whatever the order, and once every
    replica has published, a request running on another replica is not counted as queued."""
    bound = QueueBound(limit)
    queued, running = [0, 0, 0], [0, 0, 0]

    def publish(replica: int) -> None:
        if replica == 0:
            bound.published({"prefill": {"waiting": queued[0], "transferring": running[0]}})
        else:
            bound.replica_published(replica, running[replica])

    for op, r in script:
        live = sum(queued) + sum(running)
        if op == "admit":
            try:
                bound.check(live, "r")
            except Overloaded:
                assert bound.queued(live) >= limit
                continue
            queued[r] += 1
        elif op == "start" and queued[r]:
            queued[r], running[r] = queued[r] - 1, running[r] + 1
        elif op == "end_queued" and queued[r]:
            queued[r] -= 1
            bound.ended(r)
        elif op == "end_running" and running[r]:
            running[r] -= 1
            bound.ended(r)
        elif op == "publish":
            publish(r)
        elif op == "publish_all":
            for replica in range(3):
                publish(replica)
            assert bound.queued(live) == sum(queued)
        live = sum(queued) + sum(running)
        assert sum(queued) <= limit
        assert bound.queued(live) >= sum(queued)


def test_role_both_counts_a_request_once() -> None:
    """With both engines, a request holding pages on both sides is not counted twice."""
    bound = QueueBound(2)
    bound.published({"prefill": {"transferring": 2, "waiting": 1},
                     "decode": {"receiving": 3, "decoding": 0}})
    assert bound.queued(3) == 0
    bound.published({"prefill": {"waiting": 2}, "decode": {"receiving": 2, "decoding": 1}})
    assert bound.queued(3) == 0

