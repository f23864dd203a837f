"""What a worker logs and counts for the traffic a fleet sends it that is not a client's request:
clients that go away, HTTP/2 probes from SGLang's router, bodies over the limit. A real
``pdlife serve`` process; its log is read back."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service_harness import Server, idle, wait_for

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log: Path = tmp_path_factory.mktemp("logs") / "serve.log"
    s = Server(log, "--backend", "local", "--max-body-bytes", "65536")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def _until_idle(server: Server) -> None:
    wait_for(lambda: idle(server.get("/server_info")), 30, "the worker idle")


def test_a_client_that_goes_away_is_aborted_quietly(server: Server) -> None:
    body = {"text": "a long answer", "sampling_params": {"max_new_tokens": 4000,
                                                         "ignore_eos": True}}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/generate", json=body, timeout=0.3)
    wait_for(lambda: "client went away" in server.tail(20000), 30, "the abort logged")
    _until_idle(server)
    log = server.tail(20000)
    assert "never retrieved" not in log
    assert " ERROR " not in log


def test_http2_probes_are_answered_and_not_counted(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        answer = s.recv(200)
    assert answer.startswith(b"HTTP/1.1 505 ")
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'method="GET"' in metrics  # the counter exists and counts real requests
    assert 'method="PRI"' not in metrics
    assert "Invalid HTTP request" not in server.tail(20000)


def _chunks(size: int) -> Iterator[bytes]:
    for _ in range(size // 65536):
        yield b"x" * 65536


@pytest.mark.parametrize("body", ["200KB", "16MiB", "16MiB-chunked"])
def test_an_oversized_body_gets_its_413_even_when_sent_whole(server: Server, body: str) -> None:
    # urllib writes the whole body before it reads: the answer must still arrive, with a
    # declared length far beyond the socket buffers, and without one (chunked).
    headers = {"content-type": "application/json"}
    data: bytes | Iterator[bytes]
    if body == "200KB":
        data = json.dumps({"text": "x" * 200_000}).encode()
    elif body == "16MiB":
        data = json.dumps({"text": "x" * (16 << 20)}).encode()
    else:
        data, headers["transfer-encoding"] = _chunks(16 << 20), "chunked"
    request = urllib.request.Request(f"{server.url}/generate", data=data, headers=headers)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 413
    assert json.loads(refused.value.read())["error"]["type"] == "body_too_large"
