"""Chaos at the service level: ``pdlife serve`` prefill and decode processes over Mooncake,
with a decode process killed mid-transfer, a peer that never hands over a destination, and a
peer that sends garbage on the control plane. The test plays the PD router: it posts each
request to the prefill worker and to a decode worker with the same rid and bootstrap room.

One prefill process serves the module (its short bootstrap timeout is the one under test
below); the kill test runs its own, with the default bootstrap timeout. After each scenario the
prefill's KV pool must be entirely free again. Nothing here depends on how fast the machine is:
the tests wait on states and answers (with waits far beyond what they take), and what they
check holds whatever the timing (see the kill test's late rooms).
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zmq

from kv import wire
from kv.bootstrap import BootstrapClient
from scheduler.model.reference import ModelConfig
from tests.service_harness import Server, free_port, idle, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.mooncake]

MODEL = ModelConfig.tiny()
PAGE = 4
COMMON = ["--backend", "mooncake", "--page-size", str(PAGE), "--chunked-prefill-size", "32",
          "--pool-pages", "2048", "--hidden", str(MODEL.hidden), "--layers", str(MODEL.layers),
          "--heads", str(MODEL.heads), "--kv-heads", str(MODEL.kv_heads), "--head-dim",
          str(MODEL.head_dim), "--intermediate", str(MODEL.intermediate), "--max-position",
          str(MODEL.max_position), "--seed", str(MODEL.seed)]
BOOTSTRAP_TIMEOUT_S = 3.0
# How long a test waits for an answer or a state: far beyond what any takes on an idle machine,
# so that a loaded one changes only how long the test runs.
WAIT_S = 120


class Prefill:
    def __init__(self, tmp: Path, bootstrap_timeout_s: float = BOOTSTRAP_TIMEOUT_S) -> None:
        self.bootstrap_port = free_port()
        self.server = Server(tmp / "prefill.log", "--role", "prefill", "--bootstrap-port",
                             str(self.bootstrap_port), "--bootstrap-timeout",
                             str(bootstrap_timeout_s), "--log-level", "warning", *COMMON)
        self.rooms = 0

    def body(self, rid: str, prompt: list[int], new_tokens: int = 2) -> dict[str, Any]:
        self.rooms += 1
        return {"input_ids": prompt, "rid": rid,
                "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": self.rooms}

    def idle(self) -> bool:
        return idle(self.server.get("/server_info"))

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = self.server.get("/server_info")["requests"]["prefill"]
        return counts


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prefill]:
    p = Prefill(tmp_path_factory.mktemp("chaos"))
    try:
        p.server.wait_healthy()
        yield p
    finally:
        p.server.stop()


def decode_server(tmp: Path, name: str) -> Server:
    server = Server(tmp / f"{name}.log", "--role", "decode", "--log-level", "warning", *COMMON)
    return server


def post(url: str, body: dict[str, Any], timeout: float = WAIT_S) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=timeout)


def send_pair(pool: ThreadPoolExecutor, prefill: Prefill, decode: Server, body: dict[str, Any]
              ) -> tuple[Future[httpx.Response], Future[httpx.Response]]:
    return pool.submit(post, prefill.server.url, body), pool.submit(post, decode.url, body)


def prompt(i: int, n: int) -> list[int]:
    return [(31 * i + 7 * k) % 256 for k in range(n)]


def counter(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` on /metrics whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.split("{")[0].split(" ")[0] == name and all(w in line for w in want)
    )


def handshaken(prefill: Prefill) -> int:
    """Requests past their handshake: finished, or live and no longer BOOTSTRAPPING. (The
    counter is read first: a request that finishes between the two reads is counted in neither,
    never twice.)"""
    finished = counter(prefill.server.url, "pdlife_requests_finished_total")
    counts = prefill.counts()
    return int(finished) + sum(counts.values()) - counts["bootstrapping"]


def killed_peer_failure(r: httpx.Response) -> None:
    """A prefill answer for a request whose decode peer was killed: the transfer to it failed,
    naming the peer (not a timeout: the transfer and bootstrap timeouts are 300 s)."""
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "transfer_failed", r.text
    assert re.search(r"peer 127\.0\.0\.1:\d+", error["message"]), error


def test_a_killed_decode_fails_its_requests_fast_and_spares_the_rest(tmp_path: Path) -> None:
    # Its own prefill, with the default 300 s bootstrap timeout: a slow machine delays the
    # handshakes, and must not fail them.
    prefill = Prefill(tmp_path, bootstrap_timeout_s=300.0)
    doomed, healthy = decode_server(tmp_path, "doomed"), decode_server(tmp_path, "healthy")
    restarted: Server | None = None
    try:
        for server in (prefill.server, doomed, healthy):
            server.wait_healthy()
        with ThreadPoolExecutor(32) as pool:
            # Rooms whose destination reached prefill before the kill, and whose prefill half
            # comes after it: they cannot have been transferred, whatever the timing.
            late = [prefill.body(f"late-{i}", prompt(10 + i, 200)) for i in range(2)]
            on_doomed = [pool.submit(post, doomed.url, b) for b in late]
            marker = prefill.body("marker", prompt(12, 20))
            marked = pool.submit(post, doomed.url, marker)
            wait_for(lambda: doomed.get("/server_info")["requests"]["decode"]["receiving"] == 3,
                     WAIT_S, "the late rooms' destinations sent")
            # Decode aborts the marker on the same ordered socket as the destinations: prefill
            # (which has no such room) answers that abort, so that decode frees the marker's
            # pages, only after it has the late destinations.
            late_pages = sum(-(-len(b["input_ids"]) // PAGE) for b in late)
            httpx.post(f"{doomed.url}/abort_request", json={"rid": "marker"}, timeout=30)
            assert marked.result(timeout=WAIT_S).status_code == 200
            wait_for(lambda: doomed.get("/server_info")["kv_pool"]["decode"]["used_pages"]
                     == late_pages, WAIT_S, "the late destinations at prefill")
            # Long prompts, chunked: prefill computes and ships them one chunk at a time.
            calls = {}
            for i in range(8):
                peer = doomed if i % 2 else healthy
                body = prefill.body(f"kill-{i}", prompt(i, 1200))
                calls[body["rid"]] = (peer, *send_pair(pool, prefill, peer, body))
            # Every destination arrived (a request whose decode dies before sending it waits
            # for its bootstrap timeout, as in SGLang): then kill, as chunks are computed and sent.
            wait_for(lambda: handshaken(prefill) == len(calls), WAIT_S, "every handshake done")
            doomed.signal(signal.SIGKILL)
            doomed.wait(WAIT_S)
            for body in late:
                killed_peer_failure(post(prefill.server.url, body, timeout=WAIT_S))
            for future in on_doomed:
                with pytest.raises(httpx.TransportError):
                    future.result(timeout=WAIT_S)
            for rid, (peer, on_prefill, on_decode) in calls.items():
                r = on_prefill.result(timeout=WAIT_S)
                if peer is healthy:
                    assert r.status_code == 200, (rid, r.text)
                    d = on_decode.result(timeout=WAIT_S)
                    assert d.status_code == 200, (rid, d.text)
                    assert len(d.json()["output_ids"]) == 2
                elif r.status_code != 200:  # transferred before the kill, or failed by it
                    killed_peer_failure(r)
            wait_for(prefill.idle, WAIT_S, "prefill idle after the kill")

            restarted = decode_server(tmp_path, "restarted")
            restarted.wait_healthy()
            fresh = [send_pair(pool, prefill, restarted, prefill.body(f"fresh-{i}", prompt(i, 50)))
                     for i in range(3)]
            for on_prefill, on_decode in fresh:
                assert on_prefill.result(timeout=WAIT_S).status_code == 200
                assert on_decode.result(timeout=WAIT_S).status_code == 200
        wait_for(prefill.idle, WAIT_S, "prefill idle after the restarted peer's requests")
        wait_for(lambda: idle(healthy.get("/server_info")), WAIT_S, "healthy decode idle")
    finally:
        for server in (prefill.server, doomed, healthy, restarted):
            if server is not None:
                server.stop()


def test_a_peer_that_never_sends_its_destination_times_out_the_bootstrap(
    prefill: Prefill,
) -> None:
    # No decode worker ever asks for this room: the handshake never completes.
    started = time.monotonic()
    r = post(prefill.server.url, prefill.body("lonely", prompt(1, 20)))
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "bootstrap_timeout" and error["rid"] == "lonely", error
    assert f"{BOOTSTRAP_TIMEOUT_S:g} s" in error["message"], error
    assert time.monotonic() - started >= BOOTSTRAP_TIMEOUT_S
    wait_for(prefill.idle, 30, "prefill idle after the bootstrap timeout")
    # The operator sees it too (the worker logs at WARNING here).
    assert "request 'lonely' failed" in prefill.server.tail(20000)
    assert "no decode peer asked for bootstrap room" in prefill.server.tail(20000)


def dropped_on(url: str, side: str) -> float:
    """The sum of ``pdlife_control_messages_dropped_total`` for ``side`` on /metrics."""
    return counter(url, "pdlife_control_messages_dropped_total", side=side)


def test_garbage_on_the_control_plane_is_dropped_and_changes_nothing(
    prefill: Prefill, tmp_path: Path
) -> None:
    (rank,) = BootstrapClient(f"127.0.0.1:{prefill.bootstrap_port}").lookup().ranks
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(rank.endpoint)
    decode = decode_server(tmp_path, "decode")
    try:
        garbage: list[bytes] = [
            b"\x00not msgpack at all",
            b"\x81\xa1t\xa7unknown",  # msgpack {"t": "unknown"}
            wire.encode(wire.Destination(424242, "127.0.0.1:9", np.array([10**9]), 0)),
            wire.encode(wire.Destination(1, "127.0.0.1:9", np.array([-1, 2**40]), 10**6)),
        ]
        for msg in garbage:
            sock.send(msg)
        decode.wait_healthy()
        wait_for(lambda: dropped_on(prefill.server.url, "prefill") >= len(garbage), 30,
                 "every bad message dropped and counted")
        # Logged: the first of each reason (then every 1000th: a flood does not flood the log).
        assert "dropped control message" in prefill.server.tail(200_000)
        with ThreadPoolExecutor(4) as pool:
            on_prefill, on_decode = send_pair(pool, prefill, decode,
                                              prefill.body("after-garbage", prompt(3, 40)))
            assert on_prefill.result(timeout=60).status_code == 200
            assert on_decode.result(timeout=60).status_code == 200
        assert httpx.get(f"{prefill.server.url}/health", timeout=10).status_code == 200
        wait_for(prefill.idle, 30, "prefill idle after the garbage")
    finally:
        sock.close()
        ctx.term()
        decode.stop()
