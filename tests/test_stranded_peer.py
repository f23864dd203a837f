"""No stranded peer (invariant 8) between real ``pdlife serve`` processes over Mooncake: when one
worker of a PD pair refuses a request (bad input, room 0, draining), the other fails its half of
the request at once with ``peer refused: ...`` instead of holding it until its timeout. The test
plays the PD router: it posts each request to a prefill and a decode worker with the same
bootstrap fields.

Every timeout of the workers is 600 s, longer than any wait here: a request that fails within
the test's waits failed because of the refusal, which its message names.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from scheduler.model.reference import ModelConfig
from tests.service_harness import Server, free_port, idle, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.mooncake]

MODEL = ModelConfig.tiny()
# Page size 4: the prefill pool holds 256 tokens, the decode pool 512.
COMMON = ["--backend", "mooncake", "--page-size", "4", "--bootstrap-timeout", "600",
          "--waiting-timeout", "600", "--drain-timeout", "600", "--log-level", "warning",
          "--hidden", str(MODEL.hidden), "--layers", str(MODEL.layers), "--heads",
          str(MODEL.heads), "--kv-heads", str(MODEL.kv_heads), "--head-dim",
          str(MODEL.head_dim), "--intermediate", str(MODEL.intermediate), "--max-position",
          str(MODEL.max_position), "--seed", str(MODEL.seed)]
WAIT_S = 120


def prefill_server(log: Path, *flags: str) -> tuple[Server, int]:
    port = free_port()
    return Server(log, "--role", "prefill", "--bootstrap-port", str(port), "--pool-pages", "64",
                  *flags, *COMMON), port


def decode_server(log: Path) -> Server:
    return Server(log, "--role", "decode", "--pool-pages", "128", *COMMON)


class Pair:
    def __init__(self, tmp: Path) -> None:
        self.prefill, self.bootstrap_port = prefill_server(tmp / "prefill.log")
        self.decode = decode_server(tmp / "decode.log")
        self.pool = ThreadPoolExecutor(8)

    def body(self, rid: str, room: int, prompt: int, new_tokens: int = 2,
             bootstrap_port: int | None = None) -> dict[str, Any]:
        return {"input_ids": [(7 * k) % 256 for k in range(prompt)], "rid": rid,
                "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True},
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": bootstrap_port or self.bootstrap_port, "bootstrap_room": room}

    def post(self, server: Server, body: dict[str, Any]) -> Future[httpx.Response]:
        return self.pool.submit(httpx.post, f"{server.url}/generate", json=body,
                                timeout=WAIT_S)

    def stop(self) -> None:
        self.pool.shutdown()
        self.decode.stop()
        self.prefill.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(tmp_path_factory.mktemp("stranded"))
    try:
        p.prefill.wait_healthy()
        p.decode.wait_healthy()
        yield p
    finally:
        p.stop()


def failed_with(response: httpx.Response, status: int, kind: str, *fragments: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind, error
    for fragment in fragments:
        assert fragment in error["message"], error


def counter(server: Server, name: str, direction: str) -> float:
    """The server's count of ``name`` in ``direction``, summed over its DP replicas (each
    replica's series carries a ``dp_rank`` label when there are several)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)
    return sum(float(n) for labels, n in found if f'direction="{direction}"' in labels.split(","))


def by_replica(server: Server, name: str, direction: str) -> dict[str, float]:
    """The server's count of ``name`` in ``direction`` by ``dp_rank``."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.findall(rf'^{name}\{{direction="{direction}",dp_rank="(\d+)"\}} (\S+)$', text,
                       re.M)
    return {rank: float(n) for rank, n in found}


def finished(server: Server, reason: str) -> float:
    """The decode worker's count of requests that ended for ``reason``, in any state."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.findall(r'^pdlife_decode_requests_finished_total\{([^}]*)\} (\S+)$', text, re.M)
    return sum(float(n) for labels, n in found if f'reason="{reason}"' in labels)


def until_idle(*servers: Server) -> None:
    for server in servers:
        wait_for(lambda s=server: idle(s.get("/server_info")), 60, f"{server.url} idle")


def test_a_request_decode_refuses_fails_on_prefill_at_once(pair: Pair) -> None:
    # 200 + 400 tokens do not fit the decode pool (512); 200 fit the prefill pool (256).
    too_long = pair.body("decode-too-long", 101, prompt=200, new_tokens=400)
    room_zero = pair.body("room-zero", 0, prompt=20)  # decode's engine refuses room 0
    calls = [(pair.post(pair.prefill, b), pair.post(pair.decode, b)) for b in (too_long,
                                                                               room_zero)]
    (p_long, d_long), (p_zero, d_zero) = [(p.result(WAIT_S), d.result(WAIT_S)) for p, d in calls]
    failed_with(d_long, 400, "prompt_too_long")
    # Refused by decode's HTTP check: prefill answers the same status and type.
    failed_with(p_long, 400, "prompt_too_long", "peer refused: prompt_too_long (400): ")
    failed_with(d_zero, 400, "rejected")
    # Refused by decode's engine, which knows no HTTP status: 500 on prefill.
    failed_with(p_zero, 500, "bootstrap_failed", "peer refused: bootstrap_room must be non-zero")
    assert counter(pair.decode, "pdlife_decode_peer_refusals_total", "sent") >= 2
    assert counter(pair.prefill, "pdlife_peer_refusals_total", "received") >= 2
    until_idle(pair.prefill, pair.decode)


def test_a_request_prefill_refuses_fails_on_decode_at_once(pair: Pair) -> None:
    # 300 tokens do not fit the prefill pool (256); 302 fit the decode pool (512).
    after = pair.body("prefill-too-long-first", 102, prompt=300)
    refused = pair.post(pair.prefill, after).result(WAIT_S)
    failed_with(refused, 400, "prompt_too_long")
    # Decode's handshake comes after the refusal: the refusal answers it.
    failed_with(pair.post(pair.decode, after).result(WAIT_S), 400, "prompt_too_long",
                "peer refused: prompt_too_long (400): ")
    # Both at once: decode's handshake may come first, and is answered when prefill refuses.
    together = pair.body("prefill-too-long-together", 103, prompt=300)
    on_prefill, on_decode = pair.post(pair.prefill, together), pair.post(pair.decode, together)
    failed_with(on_prefill.result(WAIT_S), 400, "prompt_too_long")
    failed_with(on_decode.result(WAIT_S), 400, "prompt_too_long",
                "peer refused: prompt_too_long (400): ")
    assert counter(pair.prefill, "pdlife_peer_refusals_total", "sent") >= 2
    assert counter(pair.decode, "pdlife_decode_peer_refusals_total", "received") >= 2
    until_idle(pair.prefill, pair.decode)


def test_a_request_prefill_refuses_fails_on_decode_at_once_while_it_waits_for_pages(
    pair: Pair,
) -> None:
    """Decode's pool is taken by two requests whose prefill half never comes: the refused
    request waits there for pages, and fails when prefill refuses it (decode's ``Watch``), not
    when pages free up."""
    held = [pair.post(pair.decode, pair.body(f"held-{i}", 120 + i, prompt=200, new_tokens=40))
            for i in range(2)]  # 60 of the 128 decode pages each
    wait_for(lambda: pair.decode.get("/server_info")["requests"]["decode"]["receiving"] == 2,
             60, "the held requests waiting for their KV")
    body = pair.body("prefill-too-long-no-pages", 122, prompt=300)  # 76 pages on decode
    on_prefill, on_decode = pair.post(pair.prefill, body), pair.post(pair.decode, body)
    failed_with(on_prefill.result(WAIT_S), 400, "prompt_too_long")
    failed_with(on_decode.result(WAIT_S), 400, "prompt_too_long",
                "peer refused: prompt_too_long (400): ")
    assert pair.decode.get("/server_info")["requests"]["decode"]["receiving"] == 2
    for i in range(2):
        httpx.post(f"{pair.decode.url}/abort_request", json={"rid": f"held-{i}"}, timeout=10)
    for call in held:
        assert call.result(WAIT_S).json()["meta_info"]["finish_reason"]["type"] == "abort"
    until_idle(pair.prefill, pair.decode)


def test_a_request_prefill_fails_after_the_handshake_fails_on_decode_with_its_reason(
    pair: Pair,
) -> None:
    """The grammar compiles, then the prefill's first token reaches llguidance's lexer limit:
    the client's fault (400 ``rejected``). Decode's half, paired already, fails with the same
    type, status and reason (not as a failed transfer, which a router would retry)."""
    body = pair.body("unrunnable-grammar", 109, prompt=4)
    body["sampling_params"]["regex"] = "a{1000}{1000}"
    on_decode = pair.post(pair.decode, body)
    wait_for(lambda: pair.decode.get("/server_info")["requests"]["decode"]["receiving"] == 1,
             60, "decode's half waiting for its KV")
    failed_with(pair.post(pair.prefill, body).result(WAIT_S), 400, "rejected",
                "the grammar engine cannot run this grammar")
    failed_with(on_decode.result(WAIT_S), 400, "rejected",
                "peer refused: rejected (400): the grammar engine cannot run this grammar")
    until_idle(pair.prefill, pair.decode)


def test_a_refusal_of_a_dp_prefill_reaches_decode_for_a_room_of_any_replica(
    pair: Pair, tmp_path: Path
) -> None:
    """With DP replicas, decode asks the replica of the room for its KV: a request the prefill
    worker refuses before any engine sees it is refused by that replica, for rooms of replica 1
    as of replica 0."""
    prefill, port = prefill_server(tmp_path / "dp-prefill.log", "--dp-size", "2")
    try:
        prefill.wait_healthy()
        for room in (110, 111):  # replicas 0 and 1 (room % 2)
            body = pair.body(f"dp-too-long-{room}", room, prompt=300, bootstrap_port=port)
            on_prefill, on_decode = pair.post(prefill, body), pair.post(pair.decode, body)
            failed_with(on_prefill.result(WAIT_S), 400, "prompt_too_long")
            failed_with(on_decode.result(WAIT_S), 400, "prompt_too_long",
                        f"room {room}: peer refused: prompt_too_long (400): ")
        # Each counted by the replica that answered decode with it (its series' dp_rank).
        wait_for(lambda: by_replica(prefill, "pdlife_peer_refusals_total", "sent")
                 == {"0": 1, "1": 1}, 30, "each replica's refusal counted under its dp_rank")
    finally:
        prefill.stop()
    until_idle(pair.decode)


def test_a_refusal_never_fails_a_live_request_that_holds_the_room(pair: Pair) -> None:
    body = pair.body("retried", 108, prompt=20)
    first = pair.post(pair.decode, body)
    wait_for(lambda: pair.decode.get("/server_info")["requests"]["decode"]["receiving"] == 1,
             60, "the first try waiting for its KV")
    failed_with(pair.post(pair.decode, body).result(WAIT_S), 400, "duplicate_rid")
    # The refused retry named room 108, which the first try holds: prefill was not told.
    assert pair.post(pair.prefill, body).result(WAIT_S).status_code == 200
    answer = first.result(WAIT_S)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["output_ids"]) == 2
    until_idle(pair.prefill, pair.decode)
    # The prefill lists the decode session registered with it (its engine's host:port).
    peers = pair.prefill.get("/server_info")["peers"]
    assert len(peers) == 1 and peers[0].startswith("127.0.0.1:"), peers
    # (Other tests' prefill servers may be listed too, until decode retires them.)
    assert f"127.0.0.1:{pair.bootstrap_port}" in pair.decode.get("/server_info")["peers"]


def held_draining(server: Server, hold: dict[str, Any], peer: Pair) -> Future[httpx.Response]:
    """Start ``server`` draining with ``hold`` in flight (a request whose other half never
    comes), so it keeps refusing new requests with 503 ``draining``."""
    held = peer.post(server, hold)
    wait_for(lambda: server.get("/server_info")["live_requests"] == 1, 60, "the held request")
    server.signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 503, 60,
             "draining")
    return held


def test_a_draining_decode_fails_the_request_on_prefill_at_once(
    pair: Pair, tmp_path: Path
) -> None:
    decode = decode_server(tmp_path / "draining-decode.log")
    try:
        decode.wait_healthy()
        held = held_draining(decode, pair.body("held-on-decode", 104, prompt=10), pair)
        body = pair.body("to-a-draining-decode", 105, prompt=20)
        on_prefill, on_decode = pair.post(pair.prefill, body), pair.post(decode, body)
        failed_with(on_decode.result(WAIT_S), 503, "draining")
        failed_with(on_prefill.result(WAIT_S), 503, "draining", "peer refused: draining (503): ")
        decode.signal(signal.SIGKILL)
        decode.wait(30)
        with pytest.raises(httpx.TransportError):
            held.result(WAIT_S)
    finally:
        decode.stop()
    until_idle(pair.prefill)


def test_a_draining_prefill_fails_the_request_on_decode_at_once(
    pair: Pair, tmp_path: Path
) -> None:
    prefill, port = prefill_server(tmp_path / "draining-prefill.log")
    try:
        prefill.wait_healthy()
        held = held_draining(prefill, pair.body("held-on-prefill", 106, prompt=10,
                                                bootstrap_port=port), pair)
        body = pair.body("to-a-draining-prefill", 107, prompt=20, bootstrap_port=port)
        before = {r: finished(pair.decode, r) for r in ("prefill_draining", "bootstrap_failed")}
        on_prefill, on_decode = pair.post(prefill, body), pair.post(pair.decode, body)
        failed_with(on_prefill.result(WAIT_S), 503, "draining")
        failed_with(on_decode.result(WAIT_S), 503, "draining", "peer refused: draining (503): ")
        # A planned drain, counted apart: PdlifeDecodeRequestsFailing leaves it out.
        assert {r: finished(pair.decode, r) - n for r, n in before.items()} == {
            "prefill_draining": 1, "bootstrap_failed": 0}
        prefill.signal(signal.SIGKILL)
        prefill.wait(30)
        with pytest.raises(httpx.TransportError):
            held.result(WAIT_S)
    finally:
        prefill.stop()
    until_idle(pair.decode)


def test_a_clients_abort_on_prefill_ends_the_decode_half_as_an_abort(pair: Pair) -> None:
    """The client aborts its request on the prefill worker while the decode half waits for
    pages: the decode half ends as an abort too (200, finish reason ``abort``, counted
    ``aborted``), not as a failed transfer, which a router would retry, undoing the abort."""
    held = [pair.post(pair.decode, pair.body(f"held-for-abort-{i}", 130 + i, prompt=200,
                                             new_tokens=40)) for i in range(2)]
    wait_for(lambda: pair.decode.get("/server_info")["requests"]["decode"]["receiving"] == 2,
             60, "the held requests waiting for their KV")
    aborted = finished(pair.decode, "aborted")
    body = pair.body("aborted-on-prefill", 132, prompt=200)  # 50 pages: more than are free
    on_decode = pair.post(pair.decode, body)
    on_prefill = pair.post(pair.prefill, body)
    wait_for(lambda: pair.prefill.get("/server_info")["live_requests"] == 1, 60,
             "the prefill half waiting for decode's destination")
    r = httpx.post(f"{pair.prefill.url}/abort_request", json={"rid": "aborted-on-prefill"},
                   timeout=10)
    assert r.status_code == 200, r.text
    for answer in (on_prefill.result(WAIT_S), on_decode.result(WAIT_S)):
        assert answer.status_code == 200, answer.text
        assert answer.json()["meta_info"]["finish_reason"]["type"] == "abort", answer.text
    assert finished(pair.decode, "aborted") == aborted + 1
    for i in range(2):
        httpx.post(f"{pair.decode.url}/abort_request", json={"rid": f"held-for-abort-{i}"},
                   timeout=10)
    for call in held:
        assert call.result(WAIT_S).json()["meta_info"]["finish_reason"]["type"] == "abort"
    until_idle(pair.prefill, pair.decode)
