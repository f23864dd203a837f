"""The peer token: prefill and decode workers share one (``--peer-token-file`` or
``PDLIFE_PEER_TOKEN``, never the command line); the bootstrap endpoint and every control message
require it. A decode with a wrong or missing token is refused at registration with a reason on
both sides, its requests fail at once, and both sides count it.

The bootstrap and decode-manager checks first, in process; then real ``pdlife serve`` processes
over Mooncake: a prefill with a token file, a decode with the same token from the environment
(works), a decode with another token (refused), and a forged control message (dropped)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from kv.bootstrap import BootstrapClient, BootstrapError, BootstrapServer
from kv.metadata import MetadataBuffers
from kv.mooncake_decode import MooncakeDecodeManager
from kv.mooncake_engine import MooncakeConfig, PeerAuthError
from kv.peer_token import MIN_PEER_TOKEN_CHARS
from kv.rank_table import RankInfo, RankPlace
from scheduler.cli.command import UsageError
from scheduler.cli.credentials import PEER_TOKEN_ENV, peer_token
from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from tests.service_harness import Server, free_port, idle, model_flags, wait_for
from tests.transfer_harness import make_pool

TOKEN = "peer-token-0123456789-abcdef"
OTHER = "another-token-0123456789-xyz"


def _rank() -> RankInfo:
    return RankInfo(rank=0, endpoint="tcp://127.0.0.1:5555", session="127.0.0.1:16000",
                    page_size=4, kv_dtype="float32", head_dim=8,
                    place=RankPlace.single(num_layers=2, kv_heads=2))


# -- in process -------------------------------------------------------------------------------


def test_the_bootstrap_endpoint_counts_and_logs_refused_peers(
        caplog: pytest.LogCaptureFixture) -> None:
    server = BootstrapServer(token=TOKEN)
    try:
        good = BootstrapClient(server.address, token=TOKEN)
        good.register(_rank())
        with caplog.at_level(logging.WARNING, logger="kv.bootstrap"):
            for client in (BootstrapClient(server.address),
                           BootstrapClient(server.address, token=OTHER)):
                with pytest.raises(BootstrapError) as err:
                    client.lookup()
                assert err.value.status == 401
            with pytest.raises(BootstrapError):
                BootstrapClient(server.address, token=OTHER).refuse(7, "guess")
        assert server.unauthorized == 3
        refusals = [r.getMessage() for r in caplog.records]
        assert len(refusals) == 1, refusals  # the first, then every 100th
        assert re.search(r"refused GET /route from 127\.0\.0\.1:\d+: missing or wrong peer "
                         r"token", refusals[0]), refusals
        assert good.lookup().token_required
        assert BootstrapClient(server.address).health()  # /health stays open
        assert server.unauthorized == 3
    finally:
        server.close()


def _decode_manager(addr: str, token: str | None) -> MooncakeDecodeManager:
    return MooncakeDecodeManager(make_pool(), MetadataBuffers(4), addr,
                                 config=MooncakeConfig(token=token, connect_timeout_s=600))


@pytest.mark.parametrize(("prefill", "decode", "says"), [
    (TOKEN, OTHER, "refused this decode's peer token (a wrong one)"),
    (TOKEN, None, "refused this decode's peer token (none was sent)"),
    (None, TOKEN, "does not authenticate its peers but this decode has a peer token"),
])
def test_a_decode_whose_token_does_not_fit_fails_at_registration(
        prefill: str | None, decode: str | None, says: str) -> None:
    """At once (the connect timeout is 600 s), with the reason and the fix."""
    server = BootstrapServer(token=prefill)
    try:
        BootstrapClient(server.address, token=prefill).register(_rank())
        with pytest.raises(PeerAuthError, match=re.escape(says)) as err:
            _decode_manager(server.address, decode)
        assert "same --peer-token-file or PDLIFE_PEER_TOKEN" in str(err.value)
    finally:
        server.close()


def test_the_token_is_read_from_a_file_or_the_environment(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="scheduler.cli.credentials"):
        assert peer_token(str(path), {}) == TOKEN
        assert not caplog.records
        assert peer_token(str(path), {PEER_TOKEN_ENV: OTHER}) == TOKEN  # the flag wins, saying so
        assert [r.getMessage() for r in caplog.records] == [
            f"both --peer-token-file and {PEER_TOKEN_ENV} are set: the file's token is used"]
    assert peer_token(None, {PEER_TOKEN_ENV: f" {OTHER}\n"}) == OTHER
    assert peer_token(None, {}) is None
    assert TOKEN not in repr(MooncakeConfig(token=TOKEN))
    for mode in (0o644, 0o440):
        path.chmod(mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="scheduler.cli.credentials"):
            assert peer_token(str(path), {}) == TOKEN
        assert f"is open to users other than its owner (mode {mode:o}): chmod 600 it" \
            in caplog.text
    for bad, says in [("short", f"fewer than {MIN_PEER_TOKEN_CHARS}"), ("", "empty"),
                      ("with a space in it, long enough", "visible ASCII")]:
        with pytest.raises(UsageError, match=says):
            peer_token(None, {PEER_TOKEN_ENV: bad})
    with pytest.raises(UsageError, match="No such file"):
        peer_token(str(tmp_path / "missing"), {})
    # A library user's token is held to the same rule (an empty one let "Bearer " in).
    for bad, says in [("", "visible ASCII"), ("a shared secret", "visible ASCII"),
                      ("s3cret", f"has 6 characters, fewer than {MIN_PEER_TOKEN_CHARS}")]:
        with pytest.raises(ValueError, match=f"^MooncakeConfig.token .*{says}"):
            MooncakeConfig(token=bad)


# -- real processes over Mooncake -------------------------------------------------------------

MODEL = ModelConfig.tiny()
COMMON = ["--backend", "mooncake", "--page-size", "4", "--pool-pages", "64",
          "--bootstrap-timeout", "600", "--waiting-timeout", "600", "--log-level", "info",
          *model_flags(MODEL)]
WAIT_S = 120


class Workers:
    def __init__(self, tmp: Path) -> None:
        token_file = tmp / "prefill.token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        other_file = tmp / "other.token"
        other_file.write_text(OTHER + "\n")
        other_file.chmod(0o600)
        self.bootstrap_port = free_port()
        self.prefill = Server(tmp / "prefill.log", "--role", "prefill", "--bootstrap-port",
                              str(self.bootstrap_port), "--peer-token-file", str(token_file),
                              *COMMON)
        self.decode = Server(tmp / "decode.log", "--role", "decode", *COMMON,
                             env={PEER_TOKEN_ENV: TOKEN})
        self.stranger = Server(tmp / "stranger.log", "--role", "decode", "--peer-token-file",
                               str(other_file), *COMMON)
        self.servers = (self.prefill, self.decode, self.stranger)
        self.pool = ThreadPoolExecutor(4)

    def body(self, rid: str, room: int) -> dict[str, Any]:
        return {"input_ids": [(3 * k) % 256 for k in range(9)], "rid": rid,
                "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": room}

    def post(self, server: Server, body: dict[str, Any]) -> Any:
        return self.pool.submit(httpx.post, f"{server.url}/generate", json=body, timeout=WAIT_S)

    def stop(self) -> None:
        self.pool.shutdown()
        for server in self.servers:
            server.stop()


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    w = Workers(tmp_path_factory.mktemp("peer-token"))
    try:
        for server in w.servers:
            server.wait_healthy()
        yield w
    finally:
        w.stop()


def counter(server: Server, series: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(series))


PREFILL_REFUSED = 'pdlife_peer_auth_failures_total{side="prefill"}'
DECODE_REFUSED = 'pdlife_peer_auth_failures_total{side="decode"}'


@pytest.mark.multiprocess
@pytest.mark.mooncake
def test_a_pair_with_the_same_token_serves(workers: Workers) -> None:
    body = workers.body("same-token", 11)
    p, d = workers.post(workers.prefill, body), workers.post(workers.decode, body)
    prefill, decode = p.result(WAIT_S), d.result(WAIT_S)
    assert prefill.status_code == 200, prefill.text
    assert decode.status_code == 200, decode.text
    want = ReferenceModel(LlamaModel(MODEL)).generate(body["input_ids"], 3, (), True)
    assert decode.json()["output_ids"] == want
    assert counter(workers.decode, DECODE_REFUSED) == 0
    for server in workers.servers:  # the token is on no command line
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline and OTHER.encode() not in cmdline


@pytest.mark.multiprocess
@pytest.mark.mooncake
def test_a_decode_with_another_token_is_refused_on_both_sides(workers: Workers) -> None:
    before = counter(workers.prefill, PREFILL_REFUSED)
    body = workers.body("other-token", 12)
    p, d = workers.post(workers.prefill, body), workers.post(workers.stranger, body)
    refused = d.result(WAIT_S)  # within the test's wait, far below the 600 s timeouts
    assert refused.status_code == 500, refused.text
    error = refused.json()["error"]
    assert error["type"] == "bootstrap_failed"
    assert "refused this decode's peer token (a wrong one)" in error["message"]
    assert "--peer-token-file or PDLIFE_PEER_TOKEN" in error["message"]
    assert counter(workers.stranger, DECODE_REFUSED) == 1
    wait_for(lambda: counter(workers.prefill, PREFILL_REFUSED) > before, 30,
             "the prefill counted the refused peer")
    wait_for(lambda: "missing or wrong peer token" in workers.prefill.tail(100_000), 30,
             "the prefill logged the refused peer")
    assert "refused this decode's peer token" in workers.stranger.tail(100_000)
    # An unauthenticated peer cannot fail a room: prefill's half waits, and is aborted here.
    assert httpx.post(f"{workers.prefill.url}/abort_request", json={"rid": "other-token"},
                      timeout=10).status_code == 200
    assert p.result(WAIT_S).json()["meta_info"]["finish_reason"]["type"] == "abort"
    wait_for(lambda: idle(workers.prefill.get("/server_info")), 60, "prefill idle")


@pytest.mark.multiprocess
@pytest.mark.mooncake
def test_a_forged_control_message_is_dropped_and_counted(workers: Workers) -> None:
    table = BootstrapClient(f"127.0.0.1:{workers.bootstrap_port}", token=TOKEN).lookup()
    series = 'pdlife_control_messages_dropped_total{reason="unauthenticated",side="prefill"}'
    before = counter(workers.prefill, series)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    try:
        sock.connect(table.ranks[0].endpoint)
        for token in (OTHER, None):
            forged = {"t": "abort", "room": 12, "session": "127.0.0.1:1"}
            if token is not None:
                forged["token"] = token
            sock.send(msgpack.packb(forged))
    finally:
        sock.close()
        ctx.term()
    wait_for(lambda: counter(workers.prefill, series) == before + 2, 30,
             "the forged messages counted as unauthenticated")
    assert httpx.get(f"{workers.prefill.url}/health", timeout=10).status_code == 200
