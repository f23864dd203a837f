"""Every socket pdlife opens binds to the configured address; each Mooncake transfer engine's two
listeners bind every interface (no setting of the engine binds them), and the server says so
at start-up, naming exactly those. Checked on real ``pdlife serve`` processes over Mooncake,
from their listening sockets in ``/proc``."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kv.bootstrap import BootstrapClient
from kv.listeners import Listener, connected_ports, listening, wider_than
from kv.mooncake_engine import MooncakeConfig
from scheduler.model.reference import ModelConfig
from tests.service_harness import Server, free_port, model_flags, wait_for

MODEL = ModelConfig.tiny()
COMMON = ["--backend", "mooncake", "--page-size", "4", "--pool-pages", "64",
          "--mooncake-host", "127.0.0.1", "--log-level", "info",
          *model_flags(MODEL)]
#: The transfer engine's port range (Mooncake's default MC_MIN_RPC_PORT..MC_MAX_RPC_PORT).
ENGINE_PORTS = range(15000, 17001)
WARNING = re.compile(r"listens on every interface \(([^)]*)\)")


def test_listening_reads_this_process_sockets() -> None:
    sockets: list[socket.socket] = []
    opened = []
    try:
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::"),
                             (socket.AF_INET6, "::1"), (socket.AF_INET, "0.0.0.0")):
            s = socket.socket(family)
            sockets.append(s)
            s.bind((host, 0))
            s.listen()
            opened.append(Listener(host, s.getsockname()[1]))
        connected = socket.create_connection(("127.0.0.1", opened[0].port))
        sockets.append(connected)
        found = listening()
        assert set(opened) <= set(found)
        assert Listener("127.0.0.1", connected.getsockname()[1]) not in found  # not listening
        assert wider_than(opened, ["127.0.0.1"]) == opened[1:]
        assert wider_than(opened, ["127.0.0.1", "::1"]) == [opened[1], opened[3]]
        assert wider_than(opened, ["0.0.0.0"]) == []
    finally:
        for s in sockets:
            s.close()


def test_connected_ports_reads_this_process_connections_by_state() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        mine = client.getsockname()[1]
        assert {(mine, port), (port, mine)} <= set(connected_ports())
        accepted.close()  # the peer closed: the client's side waits in close-wait
        wait_for(lambda: (mine, port) in connected_ports(state="08"), 10.0,
                 "the client's socket in close-wait")
        assert (mine, port) not in connected_ports()
        client.close()
        assert (mine, port) not in connected_ports(state="08")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, int]]:
    tmp = tmp_path_factory.mktemp("listeners")
    bootstrap = free_port()
    prefill = Server(tmp / "prefill.log", "--role", "prefill", "--bootstrap-port",
                     str(bootstrap), *COMMON)
    decode = Server(tmp / "decode.log", "--role", "decode", *COMMON)
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        # One request: the decode server starts its engine for the prefill it first meets.
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": 5}
        with httpx.Client(timeout=120) as client, ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(client.post, f"{s.url}/generate", json=body)
                     for s in (prefill, decode)]
            assert all(c.result().status_code == 200 for c in calls)
        yield prefill, decode, bootstrap
    finally:
        decode.stop()
        prefill.stop()


def _check(server: Server, own: set[Listener], engines: int) -> None:
    found = listening(server.proc.pid)
    assert own <= set(found), (own, found)
    exposed = wider_than(found, ["127.0.0.1"])
    # pdlife's own sockets bind the configured address; what is wider is the engines': each
    # one's handshake and TCP data listeners, on every interface, in its port range.
    assert len(exposed) == 2 * engines, found
    assert all(s.wildcard and s.port in ENGINE_PORTS for s in exposed), found
    assert set(found) - set(exposed) <= {s for s in found if s.host == "127.0.0.1"}
    named = WARNING.findall(server.tail(200_000))
    assert len(named) == 1, named  # warned once, naming exactly the exposed listeners
    assert sorted(named[0].split(", ")) == sorted(map(str, exposed))


@pytest.mark.multiprocess
@pytest.mark.mooncake
def test_prefill_sockets_match_the_configuration(pair: tuple[Server, Server, int]) -> None:
    prefill, _, bootstrap = pair
    control = BootstrapClient(f"127.0.0.1:{bootstrap}").lookup().ranks[0].endpoint
    control_port = int(control.rpartition(":")[2])
    _check(prefill, {Listener("127.0.0.1", prefill.port), Listener("127.0.0.1", bootstrap),
                     Listener("127.0.0.1", control_port)}, engines=MooncakeConfig().engines)


@pytest.mark.multiprocess
@pytest.mark.mooncake
def test_decode_sockets_match_the_configuration(pair: tuple[Server, Server, int]) -> None:
    _, decode, _ = pair
    _check(decode, {Listener("127.0.0.1", decode.port)}, engines=1)


def test_a_server_without_an_engine_exposes_nothing(tmp_path: Path) -> None:
    server = Server(tmp_path / "fake.log", "--role", "prefill", "--backend", "fake",
                    *COMMON[2:])
    try:
        server.wait_healthy()
        found = listening(server.proc.pid)
        assert found == [Listener("127.0.0.1", server.port)], found
    finally:
        server.stop()
