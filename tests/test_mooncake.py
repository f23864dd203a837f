"""The Mooncake backend across two processes: prefill here, decode in a subprocess with its own
transfer engine, over loopback TCP."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kv.bootstrap import BootstrapServer
from kv.listeners import connected_ports, listening
from kv.metadata import ASKED_FIELDS, MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager
from kv.mooncake_engine import LOST_RELEASE_TIMEOUT_S, IncompatiblePeerError, MooncakeConfig
from kv.mooncake_writes import cut_blocks, row_blocks, row_fields
from kv.pool_layout import KVLayout
from kv.transfer import KVPoll
from tests.mooncake_harness import DecodePeer
from tests.service_harness import free_port, wait_for
from tests.transfer_harness import GEOMETRY, drive, make_pool

pytestmark = [pytest.mark.mooncake, pytest.mark.multiprocess]

LANES_ENV = "MC_TCP_LANES_PER_PEER"  # what MooncakeConfig.tcp_lanes sets as an engine starts

_TERMINAL = {KVPoll.SUCCESS, KVPoll.FAILED}


@pytest.fixture
def prefill(request: pytest.FixtureRequest) -> Iterator[tuple[BootstrapServer, MooncakeKVManager]]:
    """A prefill rank over a pool of random bits, in the layout the test asks for (indirect
    parametrisation), layer-major otherwise."""
    server = BootstrapServer()
    pool = make_pool(128, layout=getattr(request, "param", KVLayout.LAYER_MAJOR))
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(1)))
    manager = MooncakeKVManager(pool, MetadataBuffers(32))
    manager.register_to_bootstrap(server.address)
    yield server, manager
    manager.close()
    server.close()


def _peer(server: BootstrapServer, pages: int = 128,
          layout: KVLayout = KVLayout.LAYER_MAJOR) -> DecodePeer:
    return DecodePeer(server.address, layers=GEOMETRY["num_layers"], pages=pages,
                      page_size=GEOMETRY["page_size"], heads=GEOMETRY["kv_heads"],
                      dim=GEOMETRY["head_dim"], slots=32, layout=layout.value)


@pytest.mark.parametrize("prefill", list(KVLayout), indirect=True)
def test_many_chunked_rooms_land_byte_for_byte(
    prefill: tuple[BootstrapServer, MooncakeKVManager], tmp_path: Path
) -> None:
    server, manager = prefill
    pool, metadata = manager.pool, manager.metadata
    peer = _peer(server, layout=pool.layout)
    try:
        rng = random.Random(7)
        free = list(range(pool.num_pages))
        rng.shuffle(free)
        plan = {}
        for i in range(16):
            room = (1 << 63) + i  # rooms are unsigned 64-bit
            n = rng.randint(0, 7)
            src = [free.pop() for _ in range(n)]
            if n > 2:  # some contiguous source runs, so coalescing has work to do
                src[1:3] = sorted(src[1:3])
            dst, dslot = peer.recv(room, n)
            sender = manager.create_sender(server.address, room)
            assert drive(manager, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == (
                KVPoll.WAITING_FOR_INPUT
            )
            sender.init(n, i)
            # The first token's logprob and top alternatives travel in the row too, and the
            # named ids' logprobs for the rooms that name ids.
            top = [(2000 + i + j, -0.25 * j) for j in range(i % 4 * 6)]
            asked = [(3000 + j, -0.5 * j) for j in range(i % 3 * 2)]
            metadata.write(i, first_token=1000 + i, cached_tokens=i, logprob=-0.5 * i,
                           room=room, top=top, asked=asked)
            plan[room] = (sender, src, dst, dslot)
        # Chunks of every room interleaved, as the scheduler sends them.
        cut = {room: len(src) // 2 for room, (_, src, _, _) in plan.items()}
        for room, (sender, src, _, _) in plan.items():
            sender.send(src[: cut[room]], last=False)
        for room, (sender, src, _, _) in plan.items():
            sender.send(src[cut[room] :], last=True)
        for room, (sender, _, _, _) in plan.items():
            assert drive(manager, sender, _TERMINAL)[-1] == KVPoll.SUCCESS, room
            assert peer.done(room)["status"] == "SUCCESS"
            assert sender.quiescent()
        dump = tmp_path / "decode.pt"
        peer.dump(dump)
        landed = torch.load(dump)
        for room, (_, src, dst, dslot) in plan.items():
            assert torch.equal(landed["kv"][:, :, dst], pool.by_layer()[:, :, src]), room
            assert int(landed["room"][dslot]) == room - (1 << 64)  # int64 bits of the room
            i = room - (1 << 63)
            for field, theirs in landed["rows"].items():  # every field, byte for byte
                mine = getattr(metadata, field)[i]
                assert torch.equal(theirs[dslot].view(torch.uint8), mine.view(torch.uint8))
            assert int(landed["rows"]["top_logprob_ids"][dslot, 0]) == (2000 + i if i % 4 else -1)
            assert int(landed["rows"]["asked_logprob_ids"][dslot, 0]) == (3000 if i % 3 else -1)
        assert manager.dropped_messages.total == 0
    finally:
        peer.close()


@pytest.mark.parametrize(("engines", "budget"), [(1, 8), (3, 8), (1, 1)])
@pytest.mark.parametrize("layout", list(KVLayout))
def test_runs_spanning_rooms_under_a_small_write_budget_land_byte_for_byte(
    tmp_path: Path, layout: KVLayout, engines: int, budget: int
) -> None:
    """Rooms whose pages continue from one into the next on both sides may go out as one run;
    a budget of 8 blocks in flight cuts every send into many overlapping engine writes, and
    blocks of at most 4 KiB cut the page-major runs (1 KiB a page) into pieces; with three
    engines each write's blocks are dealt over them. A budget of one block sends each block
    alone, waiting for the one before: a send still concludes once, after its last block."""
    server = BootstrapServer()
    pool = make_pool(128, layout=layout)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(2)))
    metadata = MetadataBuffers(32)
    config = MooncakeConfig(max_blocks_in_flight=budget, max_block_bytes=4096, engines=engines)
    manager = MooncakeKVManager(pool, metadata, config=config)
    assert len(manager.engines) == engines
    manager.register_to_bootstrap(server.address)
    peer = _peer(server, layout=layout)
    try:
        plan = {}
        for i in range(6):
            room = 500 + i
            src = list(range(10 + 5 * i, 15 + 5 * i))
            dst, dslot = peer.recv(room, len(src))
            sender = manager.create_sender(server.address, room)
            assert drive(manager, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == (
                KVPoll.WAITING_FOR_INPUT
            )
            sender.init(len(src), i)
            metadata.write(i, first_token=7 + i, cached_tokens=i, logprob=-0.5 * i, room=room,
                           top=[(100 + i, -1.0)])
            plan[room] = (sender, src, dst, dslot)
        for sender, src, _, _ in plan.values():
            sender.send(src, last=True)
        for room, (sender, _, _, _) in plan.items():
            assert drive(manager, sender, _TERMINAL)[-1] == KVPoll.SUCCESS, room
            assert peer.done(room)["status"] == "SUCCESS"
            wait_for(sender.quiescent, 10, f"room {room}'s writes to end")
        dump = tmp_path / "decode.pt"
        peer.dump(dump)
        landed = torch.load(dump)
        for room, (_, src, dst, dslot) in plan.items():
            assert torch.equal(landed["kv"][:, :, dst], pool.by_layer()[:, :, src]), room
            assert int(landed["room"][dslot]) == room
            for field, theirs in landed["rows"].items():  # slots 0-5 go to 0-5: a block a field
                mine = getattr(metadata, field)[room - 500]
                assert torch.equal(theirs[dslot].view(torch.uint8), mine.view(torch.uint8))
    finally:
        peer.close()
        manager.close()
        server.close()


@pytest.mark.parametrize("lanes", [1, 6])
def test_an_engine_keeps_its_tcp_lanes_to_a_decode_peer(
    lanes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``MooncakeConfig.tcp_lanes`` is how many connections the prefill engine opens to a decode
    peer's data listener (Mooncake's own default is 4), whatever the process environment held:
    the setting goes through it. The engine opens lanes as work queues, so rounds of scattered
    pages (a block each) are sent until all are open, never more; once the peer exits, they
    stay, in close-wait, until the manager closes its engine."""
    monkeypatch.setenv(LANES_ENV, "3")  # an operator's value: the config's wins
    server = BootstrapServer()
    pool = make_pool(128)
    metadata = MetadataBuffers(32)
    manager = MooncakeKVManager(pool, metadata, config=MooncakeConfig(tcp_lanes=lanes))
    assert os.environ[LANES_ENV] == str(lanes)
    manager.register_to_bootstrap(server.address)
    peer = _peer(server)
    rng = random.Random(lanes)
    try:
        # The engine's data listener: its port beside the handshake's (the session's), in
        # Mooncake's default range (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT).
        session_port = int(peer.info["session"].rsplit(":", 1)[1])
        [data_port] = {s.port for s in listening(peer.proc.pid)
                       if 15000 <= s.port <= 17000 and s.port != session_port}

        def lanes_open(state: str = "01") -> int:
            return sum(remote == data_port for _, remote in connected_ports(state=state))

        for round_ in range(20):
            rooms = {}
            for i in range(4):
                room = 700 + 4 * round_ + i
                src = rng.sample(range(pool.num_pages), 24)  # scattered: a block a page
                peer.recv(room, len(src))
                sender = manager.create_sender(server.address, room)
                drive(manager, sender, {KVPoll.WAITING_FOR_INPUT})
                sender.init(len(src), i)
                metadata.write(i, first_token=1, cached_tokens=0, logprob=None, room=room)
                rooms[room] = (sender, src)
            for sender, src in rooms.values():
                sender.send(src, last=True)
            for room, (sender, _) in rooms.items():
                assert drive(manager, sender, _TERMINAL)[-1] == KVPoll.SUCCESS
                peer.done(room)
                sender.clear()
                peer.command(cmd="release", room=room)
            assert lanes_open() <= lanes
            if lanes_open() == lanes:
                break
        assert lanes_open() == lanes
        peer.close()  # the engine keeps the lanes of a peer gone, in close-wait (operations.md)
        wait_for(lambda: lanes_open(state="08") == lanes, 10.0,
                 "the departed peer's lanes in close-wait")
        manager.close()  # the engine goes, and the lanes with it
        wait_for(lambda: lanes_open(state="08") == 0, 10.0, "the lanes closed with the engine")
    finally:
        peer.close()
        manager.close()
        server.close()


def test_long_blocks_are_cut_into_consecutive_pieces() -> None:
    src, dst = np.array([0, 100, 200]), np.array([1000, 2000, 3000])
    assert cut_blocks(src, dst, np.array([10, 4, 3]), 4) == (
        [0, 4, 8, 100, 200], [1000, 1004, 1008, 2000, 3000], [4, 4, 2, 4, 3])
    assert cut_blocks(src, dst, np.array([4, 4, 3]), 4) == (
        [0, 100, 200], [1000, 2000, 3000], [4, 4, 3])


def test_metadata_rows_consecutive_on_both_sides_go_as_one_block_per_field() -> None:
    """Slots 0-2 go to 10-12 (given out of order), slot 5 to 3: two runs, so two blocks per
    field, field by field in order (the room's, the last field, last)."""
    src, dst, lens = row_blocks([2, 0, 1, 5], [12, 10, 11, 3], ptrs=[1000, 5000],
                                item_lens=[64, 8], dst_ptrs=[100_000, 200_000])
    assert src == [1000, 1000 + 5 * 64, 5000, 5000 + 5 * 8]
    assert dst == [100_000 + 10 * 64, 100_000 + 3 * 64, 200_000 + 10 * 8, 200_000 + 3 * 8]
    assert lens == [3 * 64, 64, 3 * 8, 8]
    assert row_blocks([], [], [1000], [64], [2000]) == ([], [], [])


def test_the_named_ids_fields_go_only_with_rows_that_carry_them() -> None:
    """A row's named-ids fields are two more blocks per run of slots: rows of requests that
    named no ids leave them out (a decode side reads them only for a request that named ids,
    and clears its slot when it takes it)."""
    metadata = MetadataBuffers(4)
    metadata.write(0, first_token=1, cached_tokens=0, logprob=None, room=5)
    metadata.write(1, first_token=1, cached_tokens=0, logprob=-1.0, room=6, asked=[(7, -2.0)])
    assert not metadata.names_ids(0) and metadata.names_ids(1)
    names = [i.name for i in metadata.buffer_infos()]
    sent = [names[f] for f in row_fields(names, named=False)]
    assert sent == [n for n in names if n not in ASKED_FIELDS] and sent[-1] == "room"
    assert row_fields(names, named=True) == list(range(len(names)))


def test_decode_refuses_a_prefill_with_another_page_size(
    prefill: tuple[BootstrapServer, MooncakeKVManager],
) -> None:
    server, _ = prefill
    with pytest.raises(IncompatiblePeerError, match="page_size"):
        MooncakeDecodeManager(make_pool(page_size=8), MetadataBuffers(4), server.address)
    with pytest.raises(IncompatiblePeerError, match="kv_dtype"):
        MooncakeDecodeManager(make_pool(dtype=torch.float16), MetadataBuffers(4), server.address)


def test_decode_refuses_a_prefill_with_another_pool_layout(
    prefill: tuple[BootstrapServer, MooncakeKVManager],
) -> None:
    server, _ = prefill
    with pytest.raises(IncompatiblePeerError, match=r"prefill .* kv_layout=layer_major, "
                       r"this decode .* kv_layout=page_major"):
        MooncakeDecodeManager(make_pool(layout=KVLayout.PAGE_MAJOR), MetadataBuffers(4),
                              server.address)


def served_mooncake(role: str, *flags: str) -> MooncakeConfig:
    """The Mooncake config ``pdlife serve --role ROLE FLAGS`` runs with."""
    from scheduler.cli.main import build_parser
    from scheduler.cli.serve import serve_config

    args = build_parser("serve").parse_args(["serve", "--role", role, *flags])
    return serve_config(args).mooncake


@pytest.mark.parametrize(("host", "why"), [
    ("0.0.0.0", "is not an address a peer can connect to"),
    ("::", "is not an address a peer can connect to"),
    ("[::]", "is not an address a peer can connect to"),
    ("::1", "take IPv4 addresses only"), ("fd00::2", "take IPv4 addresses only"),
])
def test_an_unspecified_or_ipv6_mooncake_host_is_refused(host: str, why: str) -> None:
    from scheduler.cli.command import UsageError

    with pytest.raises(UsageError, match=why):
        served_mooncake("decode", "--mooncake-host", host)


@pytest.mark.parametrize(("role", "flag", "field", "default", "given", "bad", "error"), [
    ("prefill", "--mooncake-block-mib", "max_block_bytes", 16 << 20, ("2", 2 << 20), "0",
     "--mooncake-block-mib must be >= 1"),
    ("prefill", "--mooncake-engines", "engines", 1, ("4", 4), "0",
     "--mooncake-engines must be 1-16"),
    ("prefill", "--mooncake-tcp-lanes", "tcp_lanes", MooncakeConfig().tcp_lanes, ("2", 2), "17",
     "--mooncake-tcp-lanes must be 1-16, got 17"),
    ("decode", "--retire-lost-prefill-after", "retire_lost_after_s", 60.0, ("0", None), "-1",
     "--retire-lost-prefill-after must be >= 0"),
    ("decode", "--lost-prefill-release-timeout", "lost_release_timeout_s",
     LOST_RELEASE_TIMEOUT_S, ("7.5", 7.5), "0",
     r"^--lost-prefill-release-timeout must be a finite number of seconds > 0, got 0\.0$"),
])
def test_serve_takes_the_mooncake_flags(
    role: str, flag: str, field: str, default: object, given: tuple[str, object], bad: str,
    error: str,
) -> None:
    from scheduler.cli.command import UsageError

    assert getattr(served_mooncake(role), field) == default
    assert getattr(served_mooncake(role, flag, given[0]), field) == given[1]
    with pytest.raises(UsageError, match=error):
        served_mooncake(role, flag, bad)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "-1", "0"])
def test_a_lost_prefill_release_timeout_not_finite_positive_seconds_is_refused(bad: str) -> None:
    from scheduler.cli.command import UsageError

    with pytest.raises(UsageError, match=r"^--lost-prefill-release-timeout must be a finite "
                                         r"number of seconds > 0, got "):
        served_mooncake("decode", f"--lost-prefill-release-timeout={bad}")


def test_the_config_checks_the_lanes_and_the_retirement() -> None:
    for bad in (0, 17, "4", None):
        with pytest.raises((ValueError, TypeError)):
            MooncakeConfig(tcp_lanes=bad)  # type: ignore[arg-type]
    for bad_s in (0, -1.0):
        with pytest.raises(ValueError, match="retire_lost_after_s must be > 0 or None"):
            MooncakeConfig(retire_lost_after_s=bad_s)
    assert served_mooncake("decode", "--retire-lost-prefill-after", "5").retire_lost_after_s == 5


@pytest.mark.parametrize(("low", "high", "why"), [
    ("32668", "32767", ""), ("16010", None, ""),
    ("32669", "32768", "the Mooncake transfer engine takes only a range that ends below 32768"),
    ("17000", "16000", "the range is reversed"), ("abc", "16000", "not port numbers"),
    ("16010", "16010", "one port, and a transfer engine listens on more than one"),
])
def test_a_port_range_the_engine_ignores_is_refused_by_name(
    low: str, high: str | None, why: str
) -> None:
    """Mooncake falls back to 15000-17000 for an MC_MIN_RPC_PORT..MC_MAX_RPC_PORT range it does
    not take, and says so only in its own log: the engine is refused, naming the range, rather
    than listening where a firewall written for the range would not let its peers in. (A process
    each: Mooncake reads the range once per process.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MC_M")}
    env.update({"MC_MIN_RPC_PORT": low} | ({"MC_MAX_RPC_PORT": high} if high else {}))
    script = ("from kv.mooncake_engine import MooncakeConfig, MooncakeEngine\n"
              "engine = MooncakeEngine(MooncakeConfig(hostname='127.0.0.1'))\n"
              "print(engine.session.rsplit(':', 1)[1])\nengine.close()\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    if not why:
        assert done.returncode == 0, done.stderr
        assert int(low) <= int(done.stdout.split()[-1]) <= int(high or "17000")
    else:
        # A server refuses the range before it starts any engine (a decode server starts its
        # first with its first request).
        served = subprocess.run([sys.executable, "-m", "scheduler.cli", "serve", "--role",
                                 "decode", "--backend", "mooncake", "--port", str(free_port())],
                                env=env, capture_output=True, text=True, timeout=60,
                                check=False)
        assert served.returncode == 2, served.stderr
        assert f"MC_MIN_RPC_PORT..MC_MAX_RPC_PORT is {low}-{high}: {why}" in served.stderr
        assert done.returncode != 0
        if low == high:  # the engine fails to start on it
            return
        assert re.search(rf"MooncakeError: MC_MIN_RPC_PORT..MC_MAX_RPC_PORT asks for ports "
                         rf"{low}-{high}, but the Mooncake transfer engine took 1[5-7]\d\d\d: "
                         "it ignores a range", done.stderr), done.stderr
