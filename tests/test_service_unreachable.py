"""A decode server whose request names a prefill bootstrap address nothing listens on: the
request fails at once (after ``--connect-timeout``) with ``500 bootstrap_failed``, a message
that names the address once and what to check, and the request's rid, like the other
refusals."""

from __future__ import annotations

import logging

import pytest

from kv.mooncake_engine import MooncakeConfig
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.core import ServeConfig
from tests.service_harness import asgi_client, free_port, run, running_service


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

    with caplog.at_level(logging.WARNING, logger="scheduler.decode.router"):
        message = run(main())
    logged = [r.getMessage() for r in caplog.records if r.name == "scheduler.decode.router"]
    assert logged == [f"cannot connect: {message}"]
