"""The Mooncake backend under faults: dead decode peers, bootstrap timeouts, bad control
messages, room reuse."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import pytest
import zmq

from kv import wire
from kv.bootstrap import BootstrapServer
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_engine import RECONNECT_MAX_MS, MooncakeConfig, push_socket
from kv.mooncake_rooms import silence_limit
from kv.pool_layout import KVLayout
from kv.transfer import REASON_PEER_ABORTED, KVPoll
from lifecycle.testing import FakeClock
from tests.mooncake_harness import DecodePeer
from tests.service_harness import CutShort
from tests.transfer_harness import GEOMETRY, drive, eventually, make_pool

if TYPE_CHECKING:
    from kv.mooncake_decode import MooncakeDecodeManager

pytestmark = pytest.mark.mooncake

_TERMINAL = {KVPoll.SUCCESS, KVPoll.FAILED}
TOKEN = "t0ken-0123456789abcdef"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def manager(clock: FakeClock) -> Iterator[MooncakeKVManager]:
    mgr = MooncakeKVManager(
        make_pool(), MetadataBuffers(8), clock=clock,
        config=MooncakeConfig(bootstrap_timeout_s=30.0, token=TOKEN),
    )
    yield mgr
    mgr.close()


class RawDecode:
    """Plays a decode peer's control messages on a raw ZeroMQ socket (no engine)."""

    def __init__(self, manager: MooncakeKVManager, token: str | None = TOKEN) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(manager.endpoint)
        self.token = token
        self.session = "127.0.0.1:9"
        pool = manager.pool
        infos = manager.metadata.buffer_infos()
        self.register = wire.Register(
            session=self.session, status_endpoint="tcp://127.0.0.1:9", kv_ptr=1 << 20,
            num_layers=pool.num_layers, num_pages=16, page_size=pool.page_size,
            page_bytes=pool.page_bytes, kv_dtype="float32",
            meta_ptrs=tuple(1 << 30 for _ in infos),
            meta_item_lens=tuple(i.item_len for i in infos),
            num_slots=4, kv_heads=pool.kv_heads, head_dim=pool.head_dim,
        )

    def send(self, msg: wire.Message | bytes) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else wire.encode(msg, self.token))

    def destination(self, room: int, pages: list[int], slot: int = 0) -> wire.Destination:
        return wire.Destination(room, self.session, np.array(pages), slot)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def raw(manager: MooncakeKVManager) -> Iterator[RawDecode]:
    r = RawDecode(manager)
    r.send(r.register)
    yield r
    r.close()


def _dropped(manager: MooncakeKVManager, reason: str, count: int = 1) -> None:
    eventually(lambda: manager.dropped_messages.snapshot().get(reason, 0) >= count,
               f"{count} message(s) dropped as {reason}")


def test_an_oversized_control_message_is_refused_as_it_arrives(
    manager: MooncakeKVManager, raw: RawDecode
) -> None:
    """ZeroMQ drops a message over the wire limit as it arrives (and the peer's connection),
    before any of it is buffered: 1 GiB sent to a listener had cost it 2 GiB of memory. The
    listener goes on taking messages."""
    big = RawDecode(manager)
    big.send(b"\x00" * (wire.MAX_MESSAGE_BYTES + 1))

    def a_later_message_arrived() -> bool:  # from the same socket (it reconnects)
        big.send(b"\x93\x01\x02")
        return manager.dropped_messages.snapshot().get("malformed", 0) >= 1

    eventually(a_later_message_arrived, "a message sent after the oversized one")
    big.close()
    assert "too_large" not in manager.dropped_messages.snapshot()  # never buffered whole
    sender = manager.create_sender("", 9)
    raw.send(raw.destination(9, [3]))
    assert drive(manager, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT


def test_bootstrap_timeout_on_the_injected_clock(
    manager: MooncakeKVManager, clock: FakeClock
) -> None:
    sender = manager.create_sender("", 1)
    assert sender.poll() == KVPoll.BOOTSTRAPPING
    clock.now += 29.9
    assert sender.poll() == KVPoll.BOOTSTRAPPING
    clock.now += 0.2
    assert sender.poll() == KVPoll.FAILED
    error = sender.failure_exception()
    assert error.timeout and "bootstrap timeout" in error.reason
    assert sender.quiescent()


def test_out_of_range_destination_pages_are_dropped_and_counted(
    manager: MooncakeKVManager, raw: RawDecode
) -> None:
    sender = manager.create_sender("", 5)
    raw.send(raw.destination(5, [3, 16]))  # the decode pool registered 16 pages
    raw.send(raw.destination(5, [0, 1], slot=4))  # and 4 slots
    _dropped(manager, "page_out_of_range")
    _dropped(manager, "slot_out_of_range")
    assert sender.poll() == KVPoll.BOOTSTRAPPING
    raw.send(raw.destination(5, [0, 15]))  # the listener lives on
    assert drive(manager, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT


def test_malformed_and_unauthenticated_messages_are_dropped(
    manager: MooncakeKVManager, raw: RawDecode
) -> None:
    sender = manager.create_sender("", 6)
    raw.send(b"\x93\x01\x02")  # msgpack, but not a map
    raw.send(b"\xc1garbage")
    wrong = RawDecode(manager, token="guess")
    wrong.send(wrong.destination(6, [1]))
    untokened = RawDecode(manager, token=None)
    untokened.send(untokened.destination(6, [1]))
    unknown = wire.Destination(6, "127.0.0.1:10", np.array([1]), 0)
    raw.send(unknown)
    raw.send(wire.Status(6, 4, "", 0))  # a prefill-bound socket takes no statuses
    _dropped(manager, "malformed", 2)
    _dropped(manager, "unauthenticated", 2)
    _dropped(manager, "unknown_session")
    _dropped(manager, "unexpected_type")
    wrong.close()
    untokened.close()
    assert sender.poll() == KVPoll.BOOTSTRAPPING
    raw.send(raw.destination(6, [2]))
    assert drive(manager, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT


def test_incompatible_registration_is_refused(
    manager: MooncakeKVManager, caplog: pytest.LogCaptureFixture
) -> None:
    raw = RawDecode(manager)
    status = raw.ctx.socket(zmq.PULL)
    status.setsockopt(zmq.LINGER, 0)
    port = status.bind_to_random_port("tcp://127.0.0.1")
    try:
        raw.send(attrs.evolve(raw.register, page_size=8,
                              status_endpoint=f"tcp://127.0.0.1:{port}"))
        _dropped(manager, "incompatible_layout")
        # The decode rank is told why, on its status endpoint.
        assert status.poll(10_000), "no refusal came"
        refused = wire.decode(status.recv(), TOKEN)
        assert isinstance(refused, wire.Refused) and refused.rank == 0
        assert refused.reason.startswith("incompatible_layout: (page_size, kv_dtype, kv_layout, "
                                         "metadata item lens) (8, 'float32', 'layer_major', ")
        raw.send(raw.destination(1, [0]))
        _dropped(manager, "unknown_session")
        # A pool of the other layout: the same bytes per page, at other offsets.
        raw.send(attrs.evolve(raw.register, kv_layout=KVLayout.PAGE_MAJOR.value))
        _dropped(manager, "incompatible_layout", 2)
        assert "'page_major'" in caplog.text and "'layer_major'" in caplog.text
    finally:
        status.close()
        raw.close()


def test_stale_messages_for_a_cleared_room_do_not_poison_its_reuse(
    manager: MooncakeKVManager, raw: RawDecode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kv.mooncake")
    first = manager.create_sender("", 9)
    raw.send(raw.destination(9, [1, 2]))
    assert drive(manager, first, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    first.abort()  # decode is sent the room's FAILED status
    first.clear()
    # Decode's abort, which crossed that status: answered with it again (marked ``again``).
    raw.send(wire.Abort(9, raw.session))
    second = manager.create_sender("", 9)
    raw.send(wire.Abort(9, raw.session))  # the same, after the next use's sender exists
    raw.send(raw.destination(9, [4, 5]))
    # The listener handles a session's messages in order: both aborts were, and neither
    # touched the next use.
    assert drive(manager, second, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    raw.send(wire.Abort(9, raw.session))  # now it is this room's abort
    assert drive(manager, second, _TERMINAL)[-1] == KVPoll.FAILED
    assert second.failure_exception().reason == REASON_PEER_ABORTED
    assert manager.dropped_messages.total == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.multiprocess
def test_killed_decode_fails_its_rooms_fast_and_spares_other_peers() -> None:
    server = BootstrapServer()
    pool = make_pool(64)
    manager = MooncakeKVManager(pool, MetadataBuffers(16))
    manager.register_to_bootstrap(server.address)
    geometry = {"layers": GEOMETRY["num_layers"], "page_size": GEOMETRY["page_size"],
                "heads": GEOMETRY["kv_heads"], "dim": GEOMETRY["head_dim"], "pages": 64}
    doomed, healthy = DecodePeer(server.address, **geometry), DecodePeer(server.address, **geometry)
    try:
        senders = {}
        for room, peer in [(1, doomed), (2, doomed), (3, doomed), (4, healthy)]:
            peer.recv(room, 4)
            sender = manager.create_sender(server.address, room)
            drive(manager, sender, {KVPoll.WAITING_FOR_INPUT})
            sender.init(4, room)
            senders[room] = sender
        taken = pool.allocator.alloc(16)
        assert taken is not None
        for i, sender in enumerate(senders.values()):
            sender.send(taken[4 * i : 4 * i + 2], last=False)
        eventually(lambda: all(s.quiescent() for s in senders.values()), "first chunks written")
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()
        started = time.monotonic()
        senders[1].send(taken[2:4], last=True)  # mid-transfer: its peer is gone
        assert drive(manager, senders[1], _TERMINAL, timeout=5)[-1] == KVPoll.FAILED
        error = senders[1].failure_exception()
        assert doomed.info["session"] in error.reason and error.peer == doomed.info["session"]
        # One failure blacklists the session: its other rooms fail at once, without a write.
        for room in (2, 3):
            assert drive(manager, senders[room], _TERMINAL, timeout=1)[-1] == KVPoll.FAILED
        assert time.monotonic() - started < 5
        # The other decode peer is not poisoned.
        senders[4].send(taken[14:16], last=True)
        assert drive(manager, senders[4], _TERMINAL)[-1] == KVPoll.SUCCESS
        # Failed rooms are quiescent, so their pages go back and are reusable.
        for room in (1, 2, 3):
            eventually(senders[room].quiescent, f"room {room} quiescent")
            senders[room].clear()
        pool.allocator.free(taken)
        assert pool.allocator.alloc(64) is not None
    finally:
        doomed.close()
        healthy.close()
        manager.close()
        server.close()


def test_control_sockets_back_off_from_a_peer_that_does_not_answer() -> None:
    """Both sides' control sockets (prefill's statuses, decode's registrations, destinations
    and aborts) come from ``push_socket``: ZeroMQ's retry every 100 ms to a peer gone would
    cost a prefill rank a share of a core per departed decode rank kept."""
    ctx = zmq.Context()
    sock = push_socket(ctx, "tcp://127.0.0.1:9")
    try:
        assert sock.getsockopt(zmq.RECONNECT_IVL_MAX) == RECONNECT_MAX_MS == 1000
        assert sock.getsockopt(zmq.RECONNECT_IVL) == 100 and sock.getsockopt(zmq.LINGER) == 0
    finally:
        sock.close()
        ctx.term()


def _prefill_at(port: int = 0, config: MooncakeConfig | None = None, *,
                page_size: int = GEOMETRY["page_size"],
                ) -> tuple[BootstrapServer, MooncakeKVManager]:
    """A prefill rank registered at a bootstrap endpoint on ``port`` (0: a free one)."""
    server = BootstrapServer(port=port)
    prefill = MooncakeKVManager(make_pool(page_size=page_size), MetadataBuffers(8),
                                config=config)
    prefill.register_to_bootstrap(server.address)
    return server, prefill


def _quick_heartbeat(address: str) -> MooncakeDecodeManager:
    """A decode rank whose heartbeat checks the prefill at ``address`` every 50 ms and loses
    it after two failed checks."""
    from kv.mooncake_decode import MooncakeDecodeManager

    return MooncakeDecodeManager(
        make_pool(), MetadataBuffers(8), address,
        config=MooncakeConfig(heartbeat_interval_s=0.05, heartbeat_max_failures=2),
    )


def _lands(decode: MooncakeDecodeManager, prefill: MooncakeKVManager, address: str,
           room: int) -> None:
    """A room sent from ``prefill`` lands on ``decode`` (both registered with each other)."""
    receiver = decode.create_receiver(address, room)
    receiver.init()
    receiver.send_metadata([4, 5], 1)
    sender = prefill.create_sender(address, room)
    assert drive(prefill, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    sender.init(2, 0)
    prefill.metadata.write(0, first_token=9, cached_tokens=0, logprob=None, room=room)
    sender.send([6, 7], last=True)
    assert drive(prefill, sender, _TERMINAL)[-1] == KVPoll.SUCCESS
    eventually(lambda: receiver.poll() == KVPoll.SUCCESS, f"room {room} landed on decode")


def test_decode_fails_rooms_of_a_prefill_that_stops_answering_and_registers_when_it_returns(
) -> None:
    """The decode heartbeat: a prefill whose bootstrap stops answering fails its rooms in two
    heartbeats, holding their pages until the prefill's Status, another instance of it, or the
    bound (a prefill that stopped answering may still write); once a prefill answers on the
    same address again, decode registers with it, the rooms go, and transfers resume."""
    server, prefill = _prefill_at()
    port = int(server.address.rpartition(":")[2])
    decode = _quick_heartbeat(server.address)
    try:
        waiting = decode.create_receiver(server.address, 1)
        waiting.init()
        waiting.send_metadata([0, 1], 0)
        assert waiting.poll() == KVPoll.TRANSFERRING and not waiting.quiescent()
        prefill.close()
        server.close()
        eventually(lambda: waiting.poll() == KVPoll.FAILED, "room failed after lost heartbeats")
        assert "lost contact with prefill" in waiting.failure_exception().reason
        assert not waiting.quiescent()
        late = decode.create_receiver(server.address, 2)
        assert late.poll() == KVPoll.FAILED  # while the prefill is gone, at once
        assert decode.lost is not None

        server, prefill = _prefill_at(port)
        eventually(lambda: decode.lost is None, "decode registered with the new prefill")
        assert waiting.quiescent()  # another instance answers: the old one writes no more
        _lands(decode, prefill, server.address, room=3)
    finally:
        decode.close()
        prefill.close()
        server.close()


@pytest.mark.parametrize("fault", ["cut-short", "raising"])
def test_the_heartbeat_outlives_a_failed_health_check(
    fault: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A health check answered by a server going away mid-answer (a prefill shutting down),
    or one that fails in a way nobody foresaw, counts as a failed check: the heartbeat goes on,
    loses the prefill, and registers with it again once it answers. Before, the heartbeat
    thread died of such a check, and decode never noticed the prefill leave or come back."""
    from kv.bootstrap import BootstrapClient
    server, prefill = _prefill_at()
    port = int(server.address.rpartition(":")[2])
    decode = _quick_heartbeat(server.address)
    try:
        prefill.close()
        server.close()
        if fault == "cut-short":
            with CutShort(port):
                eventually(lambda: decode.lost is not None, "the prefill lost")
        else:
            def broken(self: BootstrapClient) -> str | None:
                raise RuntimeError("a check nobody foresaw")

            with monkeypatch.context() as patch:
                patch.setattr(BootstrapClient, "instance", broken)
                eventually(lambda: decode.lost is not None, "the prefill lost")
            assert "a check nobody foresaw" in caplog.text
        server, prefill = _prefill_at(port)
        eventually(lambda: decode.lost is None, "decode registered with the new prefill")
        _lands(decode, prefill, server.address, room=3)
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_a_prefill_restarted_between_two_health_checks_is_registered_with_again() -> None:
    """A prefill restarted at the same address faster than the heartbeat fails: its bootstrap
    endpoint answers as another instance, so decode fails the rooms the old one held and
    registers with the new one (whose ranks would otherwise never hear of this decode)."""
    from kv.mooncake_decode import MooncakeDecodeManager

    server, prefill = _prefill_at()
    port = int(server.address.rpartition(":")[2])
    decode = MooncakeDecodeManager(make_pool(), MetadataBuffers(8), server.address,
                                   config=MooncakeConfig(heartbeat_interval_s=3600))
    try:
        waiting = decode.create_receiver(server.address, 1)
        waiting.init()
        waiting.send_metadata([0, 1], 0)
        eventually(lambda: bool(prefill.decode_sessions()), "decode registered")
        prefill.close()
        server.close()
        server, prefill = _prefill_at(port)
        server.add_refusal_listener(prefill.peer_refused)  # as pdlife serve wires it
        # The router sent room 1's other half to the new prefill after its restart.
        half = prefill.create_sender(server.address, 1)
        decode._wake.set()  # the next health check, without an hour's wait for it
        # Decode counts the prefill back once its Register went out (the prefill may see the
        # session first).
        eventually(lambda: bool(prefill.decode_sessions()) and decode.lost is None,
                   "decode registered again")
        assert waiting.poll() == KVPoll.FAILED and waiting.quiescent()
        assert "restarted (another instance" in waiting.failure_exception().reason
        # Refused to the new prefill: its half fails at once, not at its bootstrap timeout.
        assert drive(prefill, half, _TERMINAL)[-1] == KVPoll.FAILED
        assert half.failure_exception().refused
        assert "restarted (another instance" in half.failure_exception().reason
        _lands(decode, prefill, server.address, room=3)
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_a_room_failed_while_the_prefill_counted_as_gone_is_refused_to_it_once_it_is_back(
) -> None:
    """A restarted prefill answers before decode's heartbeat notices. A request arriving in
    between fails on decode at once, and the router sent its other half to the prefill: the
    failure wakes the heartbeat (an hour apart here), which finds the prefill back, registers
    again and refuses the room to it, so its half fails at once, not at its bootstrap
    timeout."""
    from kv.mooncake_decode import MooncakeDecodeManager

    server, prefill = _prefill_at()
    port = int(server.address.rpartition(":")[2])
    decode = MooncakeDecodeManager(make_pool(), MetadataBuffers(8), server.address,
                                   config=MooncakeConfig(heartbeat_interval_s=3600))
    try:
        prefill.close()
        server.close()
        # The heartbeat's verdict, without an hour's wait for it.
        decode._lose_prefill(f"lost contact with prefill {server.address}")
        server, prefill = _prefill_at(port, MooncakeConfig(bootstrap_timeout_s=300.0))
        server.add_refusal_listener(prefill.peer_refused)  # as pdlife serve wires it
        half = prefill.create_sender(server.address, 5)
        late = decode.create_receiver(server.address, 5)
        assert late.poll() == KVPoll.FAILED  # the prefill still counts as gone
        eventually(lambda: decode.lost is None, "the woken check found the prefill back")
        assert drive(prefill, half, _TERMINAL)[-1] == KVPoll.FAILED
        assert "lost contact with prefill" in half.failure_exception().reason
        assert half.failure_exception().refused
    finally:
        decode.close()
        prefill.close()
        server.close()


@pytest.mark.parametrize("how", ["lost", "between-checks"])
def test_a_prefill_restarted_with_another_page_size_fails_requests_with_why_and_refuses_them(
    how: str,
) -> None:
    """A prefill restarted at the same address with a page size decode's pool does not have
    answers its health check but cannot be used. From decode's first check of it on, requests
    for it fail with why (not a stale "lost contact", until the manager is retired a minute
    later), and their prefill halves, the one of a request that failed before that check too,
    are refused to it at once, not at their bootstrap timeout. Either after the heartbeat lost
    the old prefill, or when the restart came between two checks."""
    from kv.mooncake_decode import MooncakeDecodeManager

    server, prefill = _prefill_at()
    port = int(server.address.rpartition(":")[2])
    decode = MooncakeDecodeManager(make_pool(), MetadataBuffers(8), server.address,
                                   config=MooncakeConfig(heartbeat_interval_s=3600))
    try:
        prefill.close()
        server.close()
        if how == "lost":  # the heartbeat's verdict, without an hour's wait for it
            decode._lose_prefill(f"lost contact with prefill {server.address}")
        server, prefill = _prefill_at(port, MooncakeConfig(bootstrap_timeout_s=300.0),
                                      page_size=8)
        server.add_refusal_listener(prefill.peer_refused)  # as pdlife serve wires it
        early_half = prefill.create_sender(server.address, 5)
        early = decode.create_receiver(server.address, 5)
        if how == "lost":
            assert early.poll() == KVPoll.FAILED  # not checked yet: still lost
        else:
            decode._wake.set()  # the next health check, without an hour's wait for it
        eventually(lambda: "page_size=8" in (decode.lost or ""),
                   "the check found the prefill unusable")
        assert early.poll() == KVPoll.FAILED and early.quiescent()
        assert drive(prefill, early_half, _TERMINAL)[-1] == KVPoll.FAILED
        assert early_half.failure_exception().refused
        half = prefill.create_sender(server.address, 6)
        late = decode.create_receiver(server.address, 6)
        assert late.poll() == KVPoll.FAILED
        why = (f"prefill {server.address} answers but cannot be used: prefill at "
               f"{server.address} has page_size=8 kv_dtype=float32 kv_layout=layer_major, this "
               "decode pool has page_size=4")
        assert why in late.failure_exception().reason, late.failure_exception().reason
        assert drive(prefill, half, _TERMINAL)[-1] == KVPoll.FAILED  # woke the check
        assert half.failure_exception().refused
        assert why in half.failure_exception().reason
        assert decode.lost_since is not None  # the router retires it as any lost one
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_a_deregistered_session_is_forgotten_and_its_rooms_fail(
    manager: MooncakeKVManager, raw: RawDecode
) -> None:
    """A ``Deregister`` (the decode manager closed) drops the session: a room paired with it
    fails, a room it sent an early destination for fails as its sender is created, and later
    messages from it are dropped as from an unknown session until it registers again."""
    eventually(lambda: manager.decode_sessions() == [raw.session], "registered")
    paired = manager.create_sender("", 1)
    raw.send(raw.destination(1, [1, 2]))
    assert drive(manager, paired, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    raw.send(raw.destination(2, [3, 4], slot=1))  # before room 2's sender exists
    raw.send(wire.Deregister(raw.session))
    eventually(lambda: manager.decode_sessions() == [], "the session forgotten")
    gone = f"decode session {raw.session} closed"
    assert drive(manager, paired, _TERMINAL)[-1] == KVPoll.FAILED
    assert paired.failure_exception().reason == gone
    early = manager.create_sender("", 2)
    assert early.poll() == KVPoll.FAILED and gone in early.failure_exception().reason
    raw.send(raw.destination(3, [5]))
    _dropped(manager, "unknown_session")
    raw.send(wire.Deregister(raw.session))
    _dropped(manager, "unknown_session", 2)
    raw.send(raw.register)
    eventually(lambda: manager.decode_sessions() == [raw.session], "registered again")


def test_a_silent_session_is_forgotten_and_a_keepalive_changes_nothing_else(
    manager: MooncakeKVManager, raw: RawDecode, clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A decode rank re-sends its ``Register`` as a keepalive: the same one only notes the time
    (no second registration); a session silent for longer than its keepalive allows
    (``silence_limit``: six keepalives, at least 30 s) is forgotten with its rooms, and one
    that sends no keepalive (``keepalive_ms`` 0) never is."""
    eventually(lambda: manager.decode_sessions() == [raw.session], "registered")
    clock.now += 1e6
    assert manager.forget_silent() == []  # keepalive_ms 0: kept until it deregisters
    caplog.set_level(logging.INFO, logger="kv.mooncake")
    alive = attrs.evolve(raw.register, keepalive_ms=1000)
    assert silence_limit(alive) == 30.0
    raw.send(alive)  # changed: registered again, now with a keepalive
    eventually(lambda: manager.last_heard(raw.session) == clock.now, "registered again")
    paired = manager.create_sender("", 1)
    raw.send(raw.destination(1, [1, 2]))
    assert drive(manager, paired, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    for _ in range(3):  # 75 s in steps the keepalive covers
        clock.now += 25
        assert manager.forget_silent() == []
        raw.send(alive)
        eventually(lambda: manager.last_heard(raw.session) == clock.now, "the keepalive")
    registered = [r for r in caplog.records
                  if r.getMessage() == f"decode session {raw.session} registered"]
    assert len(registered) == 1, registered  # the keepalives registered nothing anew
    assert paired.poll() == KVPoll.WAITING_FOR_INPUT
    clock.now += 30
    assert manager.forget_silent() == []
    clock.now += 1.5
    assert manager.forget_silent() == [raw.session]
    assert manager.decode_sessions() == []
    assert drive(manager, paired, _TERMINAL)[-1] == KVPoll.FAILED
    assert paired.failure_exception().reason == (
        f"decode session {raw.session} went silent: no keepalive for 32 s")
    raw.send(alive)  # a decode rank that comes back registers anew
    eventually(lambda: manager.decode_sessions() == [raw.session], "registered again")


def test_a_keepalive_lifts_the_blacklist_of_a_session(
    manager: MooncakeKVManager, raw: RawDecode, clock: FakeClock
) -> None:
    """A failed write blacklists the session (its later rooms fail without a write); the
    session's next keepalive lifts it, so a failure that passed costs a live decode rank one
    keepalive interval, not every later room. (The raw peer has no engine: writes fail.)"""
    alive = attrs.evolve(raw.register, keepalive_ms=1000)
    raw.send(alive)
    eventually(lambda: manager.last_heard(raw.session) == clock.now, "registered")
    pages = manager.pool.allocator.alloc(2)
    assert pages is not None

    def written(room: int) -> str:
        sender = manager.create_sender("", room)
        raw.send(raw.destination(room, [1, 2]))
        drive(manager, sender, {KVPoll.WAITING_FOR_INPUT})
        sender.init(2, 0)
        sender.send(pages, last=True)
        assert drive(manager, sender, _TERMINAL)[-1] == KVPoll.FAILED
        eventually(sender.quiescent, f"room {room} quiescent")
        reason = sender.failure_exception().reason
        sender.clear()
        return reason

    blacklisted = f"decode session {raw.session} is blacklisted after an earlier failure"
    assert written(1) != blacklisted  # the engine's own failure
    assert written(2) == blacklisted
    clock.now += 5
    raw.send(alive)
    eventually(lambda: manager.last_heard(raw.session) == clock.now, "the keepalive")
    assert written(3) != blacklisted  # written again
    assert written(4) == blacklisted


def test_a_killed_decode_process_is_forgotten_once_its_keepalive_stops(clock: FakeClock) -> None:
    """A real decode manager's keepalive (its heartbeat, every 50 ms here) keeps its session
    registered on the prefill's clock; SIGKILL sends no ``Deregister``, and the keepalive's
    silence makes the prefill rank forget the session and fail its room."""
    server = BootstrapServer()
    manager = MooncakeKVManager(make_pool(64), MetadataBuffers(16), clock=clock)
    manager.register_to_bootstrap(server.address)
    peer = DecodePeer(server.address, layers=GEOMETRY["num_layers"],
                      page_size=GEOMETRY["page_size"], heads=GEOMETRY["kv_heads"],
                      dim=GEOMETRY["head_dim"], pages=64, heartbeat=0.05)
    try:
        session = peer.info["session"]
        eventually(lambda: manager.decode_sessions() == [session], "registered")
        for _ in range(4):  # 100 s of the prefill's clock, 20 s at a time
            clock.now += 20
            eventually(lambda: manager.last_heard(session) == clock.now, "a keepalive")
            assert manager.forget_silent() == []
        peer.recv(7, 2)
        sender = manager.create_sender(server.address, 7)
        assert drive(manager, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
        os.kill(peer.proc.pid, signal.SIGKILL)
        peer.proc.wait()

        def forgotten() -> bool:  # a keepalive still queued may touch it once more
            clock.now += 31
            manager.forget_silent()
            return manager.decode_sessions() == []

        eventually(forgotten, "the killed decode session forgotten")
        assert drive(manager, sender, _TERMINAL)[-1] == KVPoll.FAILED
        assert "went silent: no keepalive for 31 s" in sender.failure_exception().reason
    finally:
        peer.close()
        manager.close()
        server.close()


class _OlderBootstrap(BootstrapServer):
    """A prefill server from before keepalives: its table does not offer them."""

    def _table(self) -> tuple[int, Any]:
        status, table = super()._table()
        if status == 200:
            del table["keepalive"]
        return status, table


def test_a_prefill_that_predates_keepalives_gets_none(clock: FakeClock) -> None:
    """Pairing across versions: a decode sends its keepalive (the field and the repeated
    ``Register``) only to a prefill whose table offers it, so an older prefill, which refuses
    unknown fields, still takes the registration (and this side never forgets the session)."""
    from kv.mooncake_decode import MooncakeDecodeManager

    server = _OlderBootstrap()
    prefill = MooncakeKVManager(make_pool(), MetadataBuffers(8), clock=clock)
    prefill.register_to_bootstrap(server.address)
    decode = MooncakeDecodeManager(make_pool(), MetadataBuffers(8), server.address,
                                   config=MooncakeConfig(heartbeat_interval_s=0.05))
    try:
        eventually(lambda: prefill.decode_sessions() == [decode.session], "registered")
        assert not decode.prefill.keepalive
        clock.now += 1e6
        assert prefill.forget_silent() == []  # registered without a keepalive
        assert prefill.dropped_messages.total == 0
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_a_closing_decode_manager_deregisters_and_fails_its_own_rooms() -> None:
    """Closing a decode manager sends its ``Deregister``: the prefill rank forgets the session
    (and closes its status socket) and fails the room it held for it. On the decode side the
    room fails too, quiescent (the engine is gone: nothing lands), and so does a receiver
    created after the close, rather than waiting for their owner's timeout."""
    from kv.mooncake_decode import MooncakeDecodeManager

    server = BootstrapServer()
    prefill = MooncakeKVManager(make_pool(), MetadataBuffers(8))
    prefill.register_to_bootstrap(server.address)
    decode = MooncakeDecodeManager(make_pool(), MetadataBuffers(8), server.address)
    try:
        eventually(lambda: prefill.decode_sessions() == [decode.session], "registered")
        receiver = decode.create_receiver(server.address, 5)
        receiver.init()
        receiver.send_metadata([0, 1], 0)
        sender = prefill.create_sender(server.address, 5)
        assert drive(prefill, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
        decode.close()
        eventually(lambda: prefill.decode_sessions() == [], "the decode session forgotten")
        assert drive(prefill, sender, _TERMINAL)[-1] == KVPoll.FAILED
        assert sender.failure_exception().reason == f"decode session {decode.session} closed"
        assert prefill.dropped_messages.total == 0
        assert receiver.poll() == KVPoll.FAILED and receiver.quiescent()
        assert receiver.failure_exception().reason == "the decode manager closed"
        late = decode.create_receiver(server.address, 6)
        assert late.poll() == KVPoll.FAILED and late.quiescent()
    finally:
        decode.close()
        prefill.close()
        server.close()
