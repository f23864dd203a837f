"""kv.bootstrap: rank registration, lookup (503 until complete), health (and a server that says
its ranks stopped writing), bad input."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kv.bootstrap import (
    INSTANCE_HEADER,
    BootstrapClient,
    BootstrapError,
    BootstrapServer,
    PrefillStopped,
)
from kv.rank_table import RankInfo, RankPlace
from tests.service_harness import CutShort


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    srv = BootstrapServer(expected_ranks=2)
    yield srv
    srv.close()


def _rank(rank: int, page_size: int = 16, dtype: str = "bfloat16",
          layout: str = "layer_major", tp_size: int = 2) -> RankInfo:
    return RankInfo(rank=rank, endpoint=f"tcp://127.0.0.1:{7000 + rank}",
                    session=f"127.0.0.1:{8000 + rank}", page_size=page_size, kv_dtype=dtype,
                    kv_layout=layout, head_dim=8,
                    place=RankPlace(tp_rank=rank, tp_size=tp_size, kv_heads=2, num_layers=2,
                                    layer_start=0, layer_stop=2))


def _raw(srv: BootstrapServer, method: str, path: str, body: bytes = b"",
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    host, port = srv.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_binds_loopback_on_a_free_port(server: BootstrapServer) -> None:
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


def test_lookup_is_503_until_every_rank_registered(server: BootstrapServer) -> None:
    client = BootstrapClient(server.address)
    with pytest.raises(BootstrapError) as err:
        client.lookup()
    assert err.value.status == 503
    client.register(_rank(1))
    with pytest.raises(BootstrapError):
        client.lookup()
    client.register(_rank(0))
    info = client.lookup()
    assert info.page_size == 16 and info.kv_dtype == "bfloat16"
    assert info.ranks == (_rank(0), _rank(1))


def test_health(server: BootstrapServer) -> None:
    client = BootstrapClient(server.address)
    assert client.health()
    assert client.instance() == server.instance
    assert _raw(server, "GET", "/health") == (200, b"OK")
    # An engine that failed, whose ranks may still write: unhealthy, and nothing more.
    server.mark_unhealthy("the engine failed")
    assert not client.health()
    assert client.instance() is None
    assert (_raw(server, "GET", "/health")[0],
            json.loads(_raw(server, "GET", "/health")[1])) == (503, {"error": "the engine failed"})
    # One that knows no rank of it writes any more says so: decode lets the rooms go.
    server.mark_unhealthy("the engine failed", writes_stopped=True)
    assert not client.health()
    with pytest.raises(PrefillStopped) as stopped:
        client.instance()
    assert (stopped.value.reason, stopped.value.instance) == ("the engine failed",
                                                              server.instance)
    status, body = _raw(server, "GET", "/health")
    assert (status, json.loads(body)) == (503, {"error": "the engine failed",
                                                "writes_stopped": True})


def test_a_server_knows_which_decode_sessions_read_that_its_writes_stopped(
        server: BootstrapServer) -> None:
    """A decode rank's health check names its session; the server counts it as having read
    that the writes stopped only from an answer that said so, and says so for good once it
    did (a later mark without it changes only the reason)."""
    reader = BootstrapClient(server.address, session="127.0.0.1:16001")
    assert reader.instance() == server.instance  # healthy: read nothing
    server.mark_unhealthy("the engine failed")
    assert reader.instance() is None  # a 503 that says nothing of the writes
    assert server.wait_read(["127.0.0.1:16001"], 0) == {"127.0.0.1:16001"}
    server.mark_unhealthy("the prefill server shut down", writes_stopped=True)
    assert server.writes_stopped
    waiting: list[set[str]] = []
    waiter = threading.Thread(target=lambda: waiting.append(
        server.wait_read(["127.0.0.1:16001", "127.0.0.1:16002"], 10)))
    waiter.start()
    with pytest.raises(PrefillStopped):
        reader.instance()
    with pytest.raises(PrefillStopped):
        BootstrapClient(server.address).instance()  # names no session: not counted
    with pytest.raises(PrefillStopped):
        BootstrapClient(server.address, session="127.0.0.1:16002").instance()
    waiter.join(timeout=10)
    assert waiting == [set()]
    server.mark_unhealthy("the engine failed again")
    with pytest.raises(PrefillStopped) as stopped:
        reader.instance()
    assert stopped.value.reason == "the engine failed again"


def test_a_stopped_servers_reason_is_read_up_to_the_length_of_a_reason(
        server: BootstrapServer) -> None:
    server.mark_unhealthy("x" * 5000, writes_stopped=True)
    with pytest.raises(PrefillStopped) as stopped:
        BootstrapClient(server.address).instance()
    assert stopped.value.reason == "x" * 512


class _Answering(ThreadingHTTPServer):
    """An HTTP endpoint on loopback that answers every ``GET`` with ``status`` and ``body``:
    a prefill of an older version, or something else at a bootstrap address."""

    def __init__(self, status: int, body: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(status)
                self.send_header(INSTANCE_HEADER, "cafe")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=10)


@pytest.mark.parametrize(("status", "body"), [
    (503, b'{"error": "the engine failed"}'),  # a server from before the field
    (503, b'{"error": "the engine failed", "writes_stopped": "yes"}'),
    (503, b'{"writes_stopped": true}'),
    (503, b'["writes_stopped"]'),
    (503, b"Service Unavailable"),  # not a bootstrap endpoint (a proxy's answer)
    (500, b'{"error": "the engine failed", "writes_stopped": true}'),
    (200, b'{"status": "ok"}'),
])
def test_only_a_503_that_says_the_writes_stopped_says_so(status: int, body: bytes) -> None:
    """A health check that is neither ``OK`` nor a 503 saying the ranks stopped writing (with
    the reason) is read as no answer: a decode peer lets rooms go only on the latter."""
    answering = _Answering(status, body)
    try:
        client = BootstrapClient(answering.address)
        assert client.instance() is None and not client.health()
    finally:
        answering.close()


def test_a_503_that_says_the_writes_stopped_is_read_with_its_reason_and_instance() -> None:
    answering = _Answering(503, b'{"error": "the engine failed", "writes_stopped": true}')
    try:
        with pytest.raises(PrefillStopped) as stopped:
            BootstrapClient(answering.address).instance()
        assert (stopped.value.reason, stopped.value.instance) == ("the engine failed", "cafe")
    finally:
        answering.close()


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[]", b'{"rank": 0}', json.dumps(dict(json.loads(json.dumps(
        {"rank": True, "endpoint": "tcp://a:1", "session": "a:1", "page_size": 16,
         "kv_dtype": "bfloat16"})))).encode(),
     json.dumps({"rank": 0, "endpoint": "http://a", "session": "a:1", "page_size": 16,
                 "kv_dtype": "bfloat16"}).encode(),
     json.dumps({"rank": 5, "endpoint": "tcp://a:1", "session": "a:1", "page_size": 16,
                 "kv_dtype": "bfloat16"}).encode(),
     json.dumps({"rank": 0, "endpoint": "tcp://a:1", "session": "a:1", "page_size": 16,
                 "kv_dtype": "bfloat16", "model": "", "model_name": "",
                 "kv_layout": "head_major"}).encode(),
     b"\xff\xfe"],
)
def test_bad_registrations_get_400_and_change_nothing(server: BootstrapServer,
                                                      body: bytes) -> None:
    status, _ = _raw(server, "PUT", "/route", body, {"Content-Length": str(len(body))})
    assert status == 400
    assert server.ranks() == {}
    assert BootstrapClient(server.address).health()


def test_ranks_must_agree_on_geometry(server: BootstrapServer) -> None:
    client = BootstrapClient(server.address)
    client.register(_rank(0))
    with pytest.raises(BootstrapError) as err:
        client.register(_rank(1, page_size=32))
    assert err.value.status == 400
    with pytest.raises(BootstrapError, match=r"kv_layout=page_major .* kv_layout=layer_major"):
        client.register(_rank(1, layout="page_major"))
    assert set(server.ranks()) == {0}


def test_the_table_carries_the_pool_layout(server: BootstrapServer) -> None:
    client = BootstrapClient(server.address)
    for rank in (0, 1):
        client.register(_rank(rank, layout="page_major"))
    assert client.lookup().kv_layout == "page_major"


def test_unknown_route_is_404(server: BootstrapServer) -> None:
    assert _raw(server, "GET", "/nowhere")[0] == 404


def test_a_refusals_reason_is_logged_escaped(server: BootstrapServer,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """The reason is the peer's text: a newline in it must not forge a log line."""
    caplog.set_level("INFO", logger="kv.bootstrap")
    BootstrapClient(server.address).refuse(7, "draining\n2026-01-01 ERROR forged line")
    logged = [r.getMessage() for r in caplog.records if "refused room 7" in r.getMessage()]
    assert logged == ["decode peer refused room 7: 'draining\\n2026-01-01 ERROR forged line'"]


def test_token_guards_routes_but_not_health() -> None:
    srv = BootstrapServer(token="s3cret")
    try:
        with pytest.raises(BootstrapError) as err:
            BootstrapClient(srv.address).register(_rank(0, tp_size=1))
        assert err.value.status == 401
        with pytest.raises(BootstrapError):
            BootstrapClient(srv.address, token="wrong").lookup()
        good = BootstrapClient(srv.address, token="s3cret")
        good.register(_rank(0, tp_size=1))
        assert good.lookup().ranks == (_rank(0, tp_size=1),)
        assert BootstrapClient(srv.address).health()
    finally:
        srv.close()


def test_unreachable_server_is_a_bootstrap_error() -> None:
    srv = BootstrapServer()
    addr = srv.address
    srv.close()
    with pytest.raises(BootstrapError) as err:
        BootstrapClient(addr, timeout_s=1).lookup()
    assert err.value.status == 0


def test_an_answer_cut_short_is_a_bootstrap_error() -> None:
    """A server that goes away mid-answer (a prefill shutting down): every call fails as an
    unreachable server does, and a health check says the server does not answer."""
    with CutShort() as addr:
        client = BootstrapClient(addr, timeout_s=5)
        assert client.instance() is None and not client.health()
        with pytest.raises(BootstrapError) as err:
            client.lookup()
        assert err.value.status == 0 and "IncompleteRead" in err.value.detail
        with pytest.raises(BootstrapError):
            client.refuse(7, "draining")


def test_a_flood_of_idle_connections_costs_neither_threads_nor_the_endpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections beyond MAX_CONNECTIONS are closed as they are accepted (not given a thread
    each), a silent one is closed after IDLE_TIMEOUT_S, and the endpoint answers once the
    flood is gone (a thread per connection had grown a prefill to 14,000 threads, hung)."""
    import socket
    import threading

    import kv.bootstrap as bootstrap
    from tests.transfer_harness import eventually

    monkeypatch.setattr(bootstrap, "IDLE_TIMEOUT_S", 1.0)
    server = BootstrapServer()
    host, _, port = server.address.rpartition(":")
    before = threading.active_count()
    flood = []
    try:
        for _ in range(bootstrap.MAX_CONNECTIONS + 100):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /x HTTP/1.1\r\n")  # a request that never ends
            flood.append(s)
        for s in flood[-50:]:  # beyond the bound: closed as soon as accepted
            s.settimeout(30)
            assert s.recv(1024) == b""
        assert threading.active_count() <= before + bootstrap.MAX_CONNECTIONS
        # The server closes every one itself: those it turned away at once, the silent ones
        # it served after IDLE_TIMEOUT_S.
        for s in flood:
            s.settimeout(30)
            assert s.recv(1024) == b""
        eventually(lambda: threading.active_count() <= before, "their threads gone",
                   timeout=30)
        assert BootstrapClient(server.address).health()
    finally:
        for s in flood:
            s.close()
        server.close()


class _Newer(BootstrapServer):
    """The bootstrap endpoint of a prefill whose ranks carry a field this version does not
    know (a later pdlife version's)."""

    def _table(self) -> tuple[int, Any]:
        status, table = super()._table()
        if status == 200:
            for rank in table["ranks"]:
                rank["draft_layout"] = "page_major"
        return status, table


def test_a_table_of_unknown_rank_fields_is_refused_naming_them_and_the_likely_cause() -> None:
    server = _Newer(expected_ranks=1)
    try:
        client = BootstrapClient(server.address)
        client.register(_rank(0, tp_size=1))
        with pytest.raises(BootstrapError) as err:
            client.lookup()
        assert err.value.status == 200
        assert str(err.value).endswith(
            "unreadable route table (a prefill of another pdlife version?): missing fields [], "
            "unexpected ['draft_layout']"), str(err.value)
    finally:
        server.close()


class _Serving(BootstrapServer):
    """A bootstrap endpoint whose route table is ``table``, whatever registered."""

    def __init__(self, table: Any) -> None:
        super().__init__(expected_ranks=1)
        self.table = table

    def _table(self) -> tuple[int, Any]:
        return 200, self.table


@pytest.mark.parametrize(("table", "why"), [
    ({"hello": 1}, "missing fields ['ranks', 'page_size', 'kv_dtype']"),
    ([1, 2], "a JSON list, not an object"),
    ({"ranks": [], "page_size": 4, "kv_dtype": "float32"}, "no ranks"),
], ids=["other-fields", "a-list", "no-ranks"])
def test_a_table_of_another_shape_is_refused_saying_what_is_wrong(table: Any, why: str) -> None:
    server = _Serving(table)
    try:
        with pytest.raises(BootstrapError) as err:
            BootstrapClient(server.address).lookup()
        assert str(err.value).endswith(
            f"unreadable route table (a prefill of another pdlife version?): {why}"), err.value
    finally:
        server.close()
