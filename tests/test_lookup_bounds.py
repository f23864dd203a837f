"""A decode worker's look-up of the prefill server a request names is bounded, whatever that
server does: a bootstrap endpoint that answers a byte at a time fails the requests by
``--connect-timeout`` (the whole look-up's bound, not each read's), an answer over
``kv.bootstrap.MAX_ANSWER`` (4 MiB) fails the look-up unread, the requests waiting for one
look-up share it with no thread each and count as queued, and a request whose client goes away
stops waiting. Afterwards nothing is left waiting (``/server_info``'s ``connecting`` is
empty)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kv.fake import FakeDecodeManager
from kv.metadata import MetadataBuffers
from kv.mooncake_engine import MooncakeConfig, MooncakeError
from scheduler.decode.router import DecodeKVRouter, LocalPrefillFake, PeerUnreachable
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.app import create_app
from scheduler.service.core import ServeConfig
from scheduler.testing.fakes import PageEchoRunner
from tests.service_harness import asgi_client, run, running_service
from tests.transfer_harness import eventually, make_pool

#: The ports this module's bootstrap endpoints listen on (the first one free).
PORTS = range(46000, 46100)
#: The look-up's bound in these tests; every failure must come well within 10 times it.
TIMEOUT_S = 3.0
#: What the oversized answer claims (300 MiB), and how much of one without a length is sent
#: (more than ``kv.bootstrap.MAX_ANSWER``, 4 MiB).
HUGE = 300 << 20
STREAMED = 6 << 20


class Misbehaving:
    """A bootstrap endpoint on loopback whose ``GET /route`` misbehaves as ``how`` says (other
    requests, a refusal's ``POST``, get a plain ``OK``):

    - ``trickle-body``: a status line and headers promising 100,000 bytes, then one byte every
      half second;
    - ``trickle-headers``: the status line and headers themselves one byte every half second;
    - ``content-length``: ``Content-Length`` 300 MiB (then nothing);
    - ``no-length``: no ``Content-Length``, then 6 MiB until the connection ends.

    A context manager giving itself; ``lookups`` counts the ``GET /route`` connections. Leaving
    it ends every connection."""

    PACE_S = 0.5

    def __init__(self, how: str) -> None:
        self.how = how
        self.lookups = 0
        self._sock = _listen()
        self.port = int(self._sock.getsockname()[1])
        self.addr = f"127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, name="misbehaving", daemon=True)]

    def __enter__(self) -> Misbehaving:
        self._threads[0].start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._sock.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=10)

    def _accept(self) -> None:
        self._sock.settimeout(0.1)  # so that closing is noticed
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the client hung up
            conn.settimeout(None)
            request = b""
            while b"\r\n\r\n" not in request:
                more = conn.recv(65536)
                if not more:
                    return
                request += more
            if not request.startswith(b"GET /route "):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close"
                             b"\r\n\r\nOK")
                return
            with self._lock:
                self.lookups += 1
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            if self.how == "trickle-body":
                conn.sendall(head + b"Content-Length: 100000\r\n\r\n")
                self._trickle(conn, b"{" * 100000)
            elif self.how == "trickle-headers":
                self._trickle(conn, head + b"Content-Length: 2\r\n\r\n{}")
            elif self.how == "content-length":
                conn.sendall(head + f"Content-Length: {HUGE}\r\n\r\n".encode())
                conn.recv(1)  # until the client hangs up (or the server closes)
            elif self.how == "no-length":
                conn.sendall(head + b"Connection: close\r\n\r\n")
                chunk = b" " * (1 << 20)
                for _ in range(STREAMED // len(chunk)):
                    conn.sendall(chunk)
            else:
                raise AssertionError(f"no such misbehaviour {self.how!r}")

    def _trickle(self, conn: socket.socket, data: bytes) -> None:
        for i in range(len(data)):
            conn.sendall(data[i:i + 1])
            if self._stop.wait(self.PACE_S):
                return


def _listen() -> socket.socket:
    for port in PORTS:
        try:
            return socket.create_server(("127.0.0.1", port))
        except OSError:
            continue
    raise AssertionError(f"no free port in {PORTS}")


def decode_config(timeout_s: float = TIMEOUT_S, heartbeat_interval_s: float | None = None,
                  **overrides: Any) -> ServeConfig:
    mooncake = MooncakeConfig(connect_timeout_s=timeout_s)
    if heartbeat_interval_s is not None:
        mooncake = MooncakeConfig(connect_timeout_s=timeout_s,
                                  heartbeat_interval_s=heartbeat_interval_s)
    return ServeConfig(role="decode", backend="mooncake", model=ModelConfig.tiny(),
                       scheduler=SchedulerConfig(page_size=4), pool_pages=16,
                       mooncake=mooncake, **overrides)


def body(port: int, i: int) -> dict[str, Any]:
    return {"rid": f"r{i}", "input_ids": [1, 2, 3], "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port, "bootstrap_room": 100 + i}


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait, without blocking the event loop, until ``condition()`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.01)


def connect_threads() -> int:
    return sum(t.name == "pdlife-connect" for t in threading.enumerate())


@pytest.mark.mooncake
@pytest.mark.parametrize("how", ["trickle-body", "trickle-headers"])
def test_a_bootstrap_that_answers_a_byte_at_a_time_fails_the_requests_by_the_timeout(
    how: str,
) -> None:
    n = 5

    async def main(server: Misbehaving) -> None:
        with running_service(decode_config()) as service:
            router = service.decode_kv
            assert router is not None
            async with asgi_client(service) as client:
                posts = [asyncio.ensure_future(client.post("/generate", json=body(server.port, i)))
                         for i in range(n)]
                await until(lambda: service.connecting() == {server.addr: n},
                            "every request waiting for the look-up")
                # One look-up, on one thread, for all of them.
                shared, threads = router.connecting(), connect_threads()
                answers = await asyncio.wait_for(asyncio.gather(*posts), 10 * TIMEOUT_S)
                for i, r in enumerate(answers):
                    assert r.status_code == 500, r.text
                    error = r.json()["error"]
                    assert (error["type"], error["rid"]) == ("bootstrap_failed", f"r{i}")
                    assert error["message"] == (
                        f"prefill bootstrap {server.addr}: unreachable (timed out; gave up "
                        f"after --connect-timeout {TIMEOUT_S:g} s); is the prefill server "
                        f"running there with --bootstrap-port {server.port}?")
                info = (await client.get("/server_info")).json()
                assert (info["connecting"], info["live_requests"]) == ({}, 0)
                assert router.connecting() == {} and router.peers() == []
                assert (shared, threads, server.lookups) == ({server.addr: n - 1}, 1, 1)

    with Misbehaving(how) as server:
        run(main(server))


@pytest.mark.mooncake
def test_a_port_that_refuses_connections_is_retried_until_the_timeout_and_named_refused(
) -> None:
    """Nothing listens at the prefill's bootstrap port (a prefill not started yet, or dead):
    the look-up tries again until ``--connect-timeout`` and then says the connection was
    refused, the last error it met, not "timed out", which would read as a black hole."""
    with _listen() as sock:
        port = int(sock.getsockname()[1])  # free once closed: nothing listens there

    async def main() -> None:
        with running_service(decode_config(timeout_s=1.0)) as service:
            async with asgi_client(service) as client:
                loop = asyncio.get_running_loop()
                began = loop.time()
                r = await asyncio.wait_for(client.post("/generate", json=body(port, 0)),
                                           10 * TIMEOUT_S)
                waited = loop.time() - began
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["type"] == "bootstrap_failed"
        assert error["message"] == (
            f"prefill bootstrap 127.0.0.1:{port}: unreachable ([Errno 111] Connection "
            "refused; gave up after --connect-timeout 1 s); is the prefill server running "
            f"there with --bootstrap-port {port}?")
        assert waited >= 1.0, waited  # retried all along: the prefill may be starting

    run(main())


@pytest.mark.mooncake
@pytest.mark.parametrize("how", ["content-length", "no-length"])
def test_a_route_table_over_the_cap_fails_the_look_up_unread(how: str) -> None:
    size = f"Content-Length {HUGE}" if how == "content-length" else "no Content-Length"

    async def main(server: Misbehaving) -> None:
        config = decode_config(timeout_s=10 * TIMEOUT_S)
        with running_service(config) as service:
            async with asgi_client(service) as client:
                # Not retried: it fails at once, not at the connect timeout.
                r = await asyncio.wait_for(client.post("/generate", json=body(server.port, 0)),
                                           5 * TIMEOUT_S)
                assert r.status_code == 500, r.text
                error = r.json()["error"]
                assert (error["type"], error["rid"]) == ("bootstrap_failed", "r0")
                assert error["message"] == (
                    f"prefill bootstrap {server.addr}: 200: the answer to GET /route is over "
                    f"4 MiB ({size}), the most a peer reads (a route table of 1,024 ranks takes "
                    "about 0.5 MB): is a pdlife bootstrap endpoint there?")
                assert (await client.get("/server_info")).json()["connecting"] == {}

    with Misbehaving(how) as server:
        run(main(server))


@pytest.mark.mooncake
def test_a_request_whose_client_goes_away_during_the_look_up_stops_waiting() -> None:
    """The look-up goes on (for any other request naming that prefill) and ends by its
    timeout; the request is answered 499 at once, counts as waiting no more, and its room is
    refused to the prefill."""

    async def main(server: Misbehaving) -> None:
        with running_service(decode_config()) as service:
            router = service.decode_kv
            assert router is not None
            app = create_app(service)
            payload = json.dumps(body(server.port, 0)).encode()
            left = asyncio.Event()
            given = False
            sent: list[dict[str, Any]] = []

            async def receive() -> dict[str, Any]:
                nonlocal given
                if not given:
                    given = True
                    return {"type": "http.request", "body": payload, "more_body": False}
                await left.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            scope = {
                "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                "method": "POST", "scheme": "http", "path": "/generate",
                "raw_path": b"/generate", "query_string": b"", "root_path": "",
                "headers": [(b"host", b"pdlife"), (b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())],
                "client": ("127.0.0.1", 1), "server": ("pdlife", 80),
            }
            call = asyncio.ensure_future(app(scope, receive, send))
            await until(lambda: service.connecting() == {server.addr: 1},
                        "the request waiting for the look-up")
            left.set()
            await asyncio.wait_for(call, TIMEOUT_S)
            assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
            assert service.connecting() == {} and service.live_requests() == 0
            async with asgi_client(service) as client:
                assert (await client.get("/server_info")).json()["connecting"] == {}
            # Nobody waits for the look-up now; it ends by its own timeout all the same.
            assert router.connecting() in ({server.addr: 0}, {})
            await until(lambda: router.connecting() == {}, "the look-up ended",
                        10 * TIMEOUT_S)
            assert service.metrics.registry.get_sample_value(
                "pdlife_http_rejected_total", {"reason": "aborted"}) == 1

    with Misbehaving("trickle-body") as server:
        run(main(server))


@pytest.mark.mooncake
def test_requests_waiting_for_a_look_up_count_toward_the_queue_bound() -> None:
    async def main(server: Misbehaving) -> None:
        with running_service(decode_config(max_queued_requests=2)) as service:
            async with asgi_client(service) as client:
                posts = [asyncio.ensure_future(client.post("/generate", json=body(server.port, i)))
                         for i in range(2)]
                await until(lambda: service.connecting() == {server.addr: 2},
                            "two requests waiting for the look-up")
                r = await client.post("/generate", json=body(server.port, 2))
                assert r.status_code == 503, r.text
                error = r.json()["error"]
                assert (error["type"], error["rid"]) == ("overloaded", "r2")
                assert "2 requests queued, the limit is 2 (--max-queued-requests)" in \
                    error["message"]
                answers = await asyncio.wait_for(asyncio.gather(*posts), 10 * TIMEOUT_S)
                assert [a.status_code for a in answers] == [500, 500]
                assert (await client.get("/server_info")).json()["connecting"] == {}

    with Misbehaving("trickle-body") as server:
        run(main(server))


ADDR = "127.0.0.1:9"


@pytest.mark.parametrize("reachable", [False, True])
def test_waiters_share_one_look_up_thread_and_one_that_withdraws_is_not_told(
    reachable: bool,
) -> None:
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def factory(addr: str) -> FakeDecodeManager:
        calls.append(addr)
        started.set()
        assert release.wait(10)
        if not reachable:
            raise MooncakeError("prefill bootstrap lookup failed: nothing answers")
        return FakeDecodeManager()

    router = DecodeKVRouter(fake=LocalPrefillFake(PageEchoRunner(make_pool()), MetadataBuffers(8)),
                            factory=factory)
    told: dict[int, list[PeerUnreachable | None]] = {i: [] for i in range(3)}
    try:
        withdraws = [router.connect_soon(ADDR, told[i].append) for i in range(3)]
        assert started.wait(10)
        assert router.connecting() == {ADDR: 2} and connect_threads() == 1
        withdraw = withdraws[1]
        assert withdraw is not None
        withdraw()
        assert router.connecting() == {ADDR: 1}
        release.set()
        eventually(lambda: bool(told[0] and told[2]), "the waiters told", 10)
        assert calls == [ADDR] and told[1] == [] and router.connecting() == {}
        if reachable:
            assert told[0] == told[2] == [None] and router.peers() == [ADDR]
            assert router.connect_soon(ADDR, told[0].append) is None  # connected already
        else:
            assert [str(e) for e in told[0] + told[2]] == [
                f"prefill bootstrap {ADDR}: prefill bootstrap lookup failed: nothing answers"] * 2
            assert told[0][0] is not told[2][0]  # each waiter raises its own
            assert router.peers() == []
    finally:
        release.set()
        router.close()


@pytest.mark.mooncake
def test_a_request_for_a_prefill_that_counts_as_gone_fails_before_its_stream_starts() -> None:
    """A decode that paired with a prefill which then stopped answering (or came back with
    settings decode cannot use) fails a request for it at once, before a stream's first byte:
    500 ``bootstrap_failed`` naming why, as a failed look-up is, which a router retries on
    another pair (a stream's 200 with an error event it cannot retry)."""
    from tests.service_harness import free_port

    bootstrap_port = free_port()
    prefill_config = ServeConfig(
        role="prefill", backend="mooncake", model=ModelConfig.tiny(),
        scheduler=SchedulerConfig(page_size=4), pool_pages=64, metadata_slots=8,
        bootstrap_port=bootstrap_port)

    async def main() -> None:
        # No health check of the decode's own comes between the verdict below and the
        # requests (one would find the prefill answering and register with it again).
        with running_service(prefill_config) as prefill, running_service(
                decode_config(heartbeat_interval_s=3600)) as decode:
            async with asgi_client(prefill) as p, asgi_client(decode) as d:
                first = body(bootstrap_port, 0)
                answers = await asyncio.gather(p.post("/generate", json=first),
                                               d.post("/generate", json=first))
                assert [r.status_code for r in answers] == [200, 200], answers[1].text
                router = decode.decode_kv
                assert router is not None
                addr = f"127.0.0.1:{bootstrap_port}"
                [manager] = [m for m in router.managers() if getattr(m, "bootstrap_addr",
                                                                      None) == addr]
                why = f"lost contact with prefill {addr}: 2 health checks in a row failed"
                manager._lose_prefill(why)  # the heartbeat's verdict, without its wait
                for stream in (True, False):
                    r = await d.post("/generate", json={**body(bootstrap_port, 1 + stream),
                                                        "stream": stream})
                    assert r.status_code == 500, r.text
                    error = r.json()["error"]
                    assert (error["type"], error["message"]) == ("bootstrap_failed", why)
                info = (await d.get("/server_info")).json()
                assert (info["connecting"], info["live_requests"]) == ({}, 0)

    run(main())
