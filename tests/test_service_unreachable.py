"""A decode server whose request names a prefill bootstrap address nothing listens on: the
request fails at once (after ``--connect-timeout``) with ``500 bootstrap_failed``, a message
that names the address once and what to check, and the request's rid, like the other
refusals."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kv.mooncake_engine import MooncakeConfig
from scheduler.decode.router import DecodeKVRouter
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.core import ServeConfig
from tests.service_harness import asgi_client, free_port, run, running_service
from tests.transfer_harness import eventually


@pytest.mark.mooncake
def test_an_unreachable_prefill_fails_the_request_naming_its_address_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()  # closed again: nothing listens there
    addr = f"127.0.0.1:{port}"
    config = ServeConfig(role="decode", backend="mooncake", model=ModelConfig.tiny(),
                         scheduler=SchedulerConfig(page_size=4), pool_pages=16,
                         mooncake=MooncakeConfig(connect_timeout_s=0.2))

    async def main() -> str:
        with running_service(config) as service:
            async with asgi_client(service) as client:
                r = await client.post("/generate", json={
                    "rid": "lost-1", "input_ids": [1, 2, 3], "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": port, "bootstrap_room": 77})
                assert r.status_code == 500, r.text
                error = r.json()["error"]
                assert error["type"] == "bootstrap_failed"
                assert error["rid"] == "lost-1"
                message = error["message"]
                assert message.startswith(f"prefill bootstrap {addr}: unreachable ("), message
                assert message.count(str(port)) == 2, message  # the address and the flag
                assert message.endswith(
                    f"is the prefill server running there with --bootstrap-port {port}?")
                assert service.live_requests() == 0
                return str(message)

    with caplog.at_level(logging.INFO):
        message = run(main())
    logged = [r.getMessage() for r in caplog.records if r.name == "scheduler.decode.router"]
    assert logged == [f"cannot connect: {message}"]
    # The client's rid, to find its request in the log by.
    logged = [r.getMessage() for r in caplog.records if r.name == "scheduler.service.handoff"]
    assert logged == [f"refused ['lost-1'] (500 bootstrap_failed): {message}"]


@pytest.mark.mooncake
def test_a_request_waiting_for_its_prefills_look_up_is_refused_when_the_server_drains(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The look-up of a prefill server nothing answers takes up to ``--connect-timeout``; the
    drain does not wait for it (the request is refused ``draining``), and closing the service
    ends the look-up, which is not logged as a lost peer."""
    port = free_port()
    config = ServeConfig(role="decode", backend="mooncake", model=ModelConfig.tiny(),
                         scheduler=SchedulerConfig(page_size=4), pool_pages=16,
                         mooncake=MooncakeConfig(connect_timeout_s=600))
    addr = f"127.0.0.1:{port}"

    async def main() -> DecodeKVRouter:
        with running_service(config) as service:
            router = service.decode_kv
            assert router is not None
            async with asgi_client(service) as client:
                waiting = asyncio.ensure_future(client.post("/generate", json={
                    "rid": "w", "input_ids": [1, 2, 3], "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": port, "bootstrap_room": 78}))
                for _ in range(3000):  # until the look-up is under way (30 s at most)
                    if router.connecting() == {addr: 0}:
                        break
                    await asyncio.sleep(0.01)
                assert router.connecting() == {addr: 0}
                info = (await client.get("/server_info")).json()
                assert (info["connecting"], info["live_requests"]) == ({addr: 1}, 0)
                service.begin_drain()
                r = await asyncio.wait_for(waiting, 30)
                assert r.status_code == 503, r.text
                assert (r.json()["error"]["type"], r.json()["error"]["rid"]) == ("draining", "w")
                assert (await client.get("/server_info")).json()["connecting"] == {}
                assert service.wait_drained(0)
        return router

    with caplog.at_level(logging.INFO, logger="scheduler.decode.router"):
        router = run(main())
        # Closing the service ended the look-up (not its 600 s timeout).
        eventually(lambda: router.connecting() == {}, "the look-up ended")
    assert router.peers() == []
    logged = [(r.levelno, r.getMessage()) for r in caplog.records
              if r.name == "scheduler.decode.router"]
    assert logged == [(logging.INFO, f"cannot connect: prefill bootstrap {addr}: "
                                     "prefill bootstrap lookup stopped: closing")]
