"""No stranded peer (invariant 8), below the HTTP service: a room one side refuses, or fails
before the handshake, fails on the other side at once with ``peer refused: ...``, over the local
backend, over Mooncake (both managers in this process, the bootstrap endpoint between them), and
through a prefill scheduler and a decode peer stepped together. Timeouts are never the cause:
the schedulers' clock does not move."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import attrs
import numpy as np
import pytest
import zmq

from kv import wire
from kv.bootstrap import BootstrapClient, BootstrapError, BootstrapServer
from kv.local import LocalKVManager, LocalTransferHub
from kv.local_decode import LocalDecodeManager
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager
from kv.mooncake_engine import MooncakeConfig, push_socket
from kv.pool import KVGeometryError
from kv.rank_table import RankPlace
from kv.refusal import RefusalPoster, RefusedRooms
from kv.transfer import KVPoll, TransferError
from lifecycle import DecodeState, FailureReason, PrefillState, SamplingParams
from lifecycle.testing import FakeClock
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.messages import NewRequest
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.stepping import step_until
from tests.transfer_harness import drive, eventually, make_pool

ADDR = "local:refusals"


def _refused(err: TransferError, why: str) -> bool:
    return err.refused and f"peer refused: {why}" in err.reason


# -- the record --------------------------------------------------------------------------------


def test_the_record_is_bounded_and_expires() -> None:
    clock = FakeClock()
    rooms = RefusedRooms(capacity=2, ttl_s=10.0, clock=clock)
    rooms.add(1, "one")
    rooms.add(2, "two")
    rooms.add(3, "three")  # the oldest goes
    assert (rooms.get(1), rooms.get(2), rooms.get(3), len(rooms)) == (None, "two", "three", 2)
    clock.now += 9.5
    rooms.add(2, "again")  # refreshed
    clock.now += 1.0
    assert (rooms.get(3), rooms.get(2)) == (None, "again")
    assert rooms.pop(2) == "again" and rooms.pop(2) is None and len(rooms) == 0
    with pytest.raises(ValueError, match="capacity"):
        RefusedRooms(capacity=0)


def test_a_refusal_nobody_takes_is_logged_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kv.refusal")
    poster = RefusalPoster(timeout_s=1.0, attempts=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        poster.tell(nobody, 31, "draining")
        eventually(lambda: any("could not tell prefill" in r.getMessage()
                               for r in caplog.records), "the failed delivery logged")
    poster.close()
    poster.tell(nobody, 32, "after close")  # ignored
    assert poster.delivered == 0
    assert "room 31" in caplog.records[0].getMessage()
    assert caplog.records[0].getMessage().count(nobody) == 1  # the address once


def test_closing_posts_each_refusal_once_and_skips_a_prefill_that_hangs(
        caplog: pytest.LogCaptureFixture) -> None:
    """A prefill whose bootstrap endpoint accepts connections and never answers: a decode
    worker shutting down does not wait out three timeouts for each of its refusals (it took
    15 s to exit for one); what is queued is posted once, then no more to that prefill."""
    caplog.set_level(logging.WARNING, "kv.refusal")
    held: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as hung:
        hung.settimeout(0.05)
        done = threading.Event()

        def accept() -> None:  # take each connection, answer nothing
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    held.append(hung.accept()[0])

        acceptor = threading.Thread(target=accept)
        acceptor.start()
        addr = f"127.0.0.1:{hung.getsockname()[1]}"
        poster = RefusalPoster(timeout_s=0.3, attempts=3)
        for room in (41, 42, 43):
            poster.tell(addr, room, "draining")
        poster.close()
        done.set()
        acceptor.join()
    for conn in held:
        conn.close()
    # Room 41 three times at most (if its posting began before the close), then nothing more.
    assert 1 <= len(held) <= 3, len(held)
    assert poster.delivered == 0
    logged = [r.getMessage() for r in caplog.records]
    assert any("room 43 was refused: it did not answer the last refusal" in m for m in logged)


# -- local backend -----------------------------------------------------------------------------


class Local:
    def __init__(self) -> None:
        hub = LocalTransferHub()
        self.prefill = LocalKVManager(make_pool(), MetadataBuffers(4), hub=hub,
                                      bootstrap_addr=ADDR)
        self.decode = LocalDecodeManager(make_pool(), MetadataBuffers(4), hub=hub)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture
def local() -> Iterator[Local]:
    pair = Local()
    yield pair
    pair.close()


def test_local_a_prefill_refusal_fails_the_destination_sent_before_or_after(local: Local) -> None:
    early = local.decode.create_receiver(ADDR, 1)
    early.init()
    early.send_metadata([0, 1], 0)
    local.prefill.refuse(1, "draining")
    local.prefill.refuse(2, "prompt_too_long")
    late = local.decode.create_receiver(ADDR, 2)
    late.init()
    late.send_metadata([2], 1)
    for receiver, why in ((early, "draining"), (late, "prompt_too_long")):
        assert receiver.poll() == KVPoll.FAILED
        assert _refused(receiver.failure_exception(), why)
        assert receiver.quiescent()


def test_local_a_prefill_room_ended_before_its_destination_answers_it(local: Local) -> None:
    sender = local.prefill.create_sender(ADDR, 3)
    sender.abort()  # the client went away while the room waited for decode
    before_clear = local.decode.create_receiver(ADDR, 3)
    before_clear.init()
    before_clear.send_metadata([0], 0)
    assert _refused(before_clear.failure_exception(), "aborted")
    sender.clear()
    after_clear = local.decode.create_receiver(ADDR, 3)
    after_clear.init()
    after_clear.send_metadata([1], 1)
    assert after_clear.poll() == KVPoll.FAILED
    assert _refused(after_clear.failure_exception(), "aborted")


def test_local_a_decode_refusal_fails_the_sender_waiting_or_still_to_come(local: Local) -> None:
    waiting = local.prefill.create_sender(ADDR, 4)
    local.decode.refuse(ADDR, 4, "draining")
    local.decode.refuse(ADDR, 5, "bootstrap_room must be non-zero")
    assert drive(local.prefill, waiting, {KVPoll.FAILED})[-1] == KVPoll.FAILED
    assert _refused(waiting.failure_exception(), "draining")
    later = local.prefill.create_sender(ADDR, 5)
    assert later.poll() == KVPoll.FAILED
    assert _refused(later.failure_exception(), "bootstrap_room must be non-zero")
    local.decode.refuse("local:nobody", 6, "no prefill there")  # nobody to tell: no error


def test_local_a_decode_pool_that_cannot_take_the_prefills_kv_fails_the_sender_at_once() -> None:
    """A pool of another page size (found when the receiver resolves the prefill server, at
    init or when the server's last rank registers) is the decode side giving the room up: the
    prefill's sender fails with the reason, as for any refusal, not at its timeout."""
    hub = LocalTransferHub()
    decode = LocalDecodeManager(make_pool(page_size=8), MetadataBuffers(4), hub=hub)
    prefill = LocalKVManager(make_pool(), MetadataBuffers(4), hub=hub, bootstrap_addr=ADDR)
    try:
        sender = prefill.create_sender(ADDR, 7)
        receiver = decode.create_receiver(ADDR, 7)
        with pytest.raises(KVGeometryError, match="differ in page_size"):
            receiver.init()
        assert drive(prefill, sender, {KVPoll.FAILED})[-1] == KVPoll.FAILED
        err = sender.failure_exception()
        assert err.refused and "differ in page_size" in err.reason, err
        with pytest.raises(KVGeometryError):
            decode.create_receiver(ADDR, 8).init()
        later = prefill.create_sender(ADDR, 8)  # refused before its sender existed
        assert later.poll() == KVPoll.FAILED
        assert "differ in page_size" in later.failure_exception().reason
    finally:
        prefill.close()
        decode.close()


def test_local_a_refused_room_in_use_keeps_its_own_destination(local: Local) -> None:
    sender = local.prefill.create_sender(ADDR, 7)
    local.prefill.refuse(7, "bootstrap room 7 is in use by a live request")
    own = local.decode.create_receiver(ADDR, 7)
    own.init()
    own.send_metadata([0], 0)
    assert sender.poll() == KVPoll.WAITING_FOR_INPUT and own.poll() == KVPoll.TRANSFERRING
    local.decode.refuse(ADDR, 7, "a paired room is not refused")
    assert sender.poll() == KVPoll.WAITING_FOR_INPUT


def test_local_a_watching_receiver_leaves_no_group_behind(local: Local) -> None:
    """A receiver that waits for pages watches its room's group (the contract suite checks
    what it hears); once the room ended on both sides and both ends were cleared, no group is
    left, whether the room failed on prefill or decode never sent its destination."""
    refused, aborted, unused = (local.decode.create_receiver(ADDR, room) for room in (30, 31, 32))
    for receiver in (refused, aborted, unused):
        receiver.init()
    sender = local.prefill.create_sender(ADDR, 31)
    assert local.decode.hub.open_rooms(ADDR) == 3
    local.prefill.refuse(30, "draining (503): the server is draining")
    sender.abort()
    assert refused.poll() == aborted.poll() == KVPoll.FAILED
    unused.abort()  # the decode peer gave up on it (its client went away)
    for end in (refused, aborted, unused, sender):
        end.clear()
    assert local.decode.hub.open_rooms(ADDR) == 0


def test_local_a_waiting_receiver_is_not_failed_by_a_decode_side_failure(local: Local) -> None:
    """What the decode side refused itself is not news to its receivers: only the sender
    fails; a receiver of the room that still waits for pages keeps waiting, and once it sends
    its destination the room of a later sender pairs."""
    receiver = local.decode.create_receiver(ADDR, 34)
    receiver.init()
    waiting = local.prefill.create_sender(ADDR, 34)
    local.decode.refuse(ADDR, 34, "draining (503): the decode server is draining")
    assert waiting.poll() == KVPoll.FAILED
    assert receiver.poll() == KVPoll.WAITING_FOR_INPUT
    waiting.clear()
    sender = local.prefill.create_sender(ADDR, 34)
    receiver.send_metadata([0], 0)
    assert sender.poll() == KVPoll.WAITING_FOR_INPUT
    assert receiver.poll() == KVPoll.TRANSFERRING


# -- Mooncake: both managers here, the bootstrap endpoint between them -------------------------


class Mooncake:
    def __init__(self, clock: FakeClock | None = None,
                 config: MooncakeConfig | None = None) -> None:
        self.bootstrap = BootstrapServer()
        self.prefill = MooncakeKVManager(make_pool(), MetadataBuffers(4), config=config,
                                         clock=clock or time.monotonic)
        self.prefill.register_to_bootstrap(self.bootstrap.address)
        self.bootstrap.add_refusal_listener(self.prefill.peer_refused)
        self.decode = MooncakeDecodeManager(make_pool(), MetadataBuffers(4),
                                            self.bootstrap.address)

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        self.bootstrap.close()


@pytest.fixture
def mooncake() -> Iterator[Mooncake]:
    pair = Mooncake()
    yield pair
    pair.close()


@pytest.mark.mooncake
def test_mooncake_a_decode_refusal_reaches_prefill_through_its_bootstrap(
    mooncake: Mooncake,
) -> None:
    addr = mooncake.bootstrap.address
    waiting = mooncake.prefill.create_sender(addr, 11)
    mooncake.decode.refuse(addr, 11, "draining: the server is draining (shutting down)")
    mooncake.decode.refuse(addr, 12, "invalid_request: max_new_tokens: must be >= 1")
    assert drive(mooncake.prefill, waiting, {KVPoll.FAILED})[-1] == KVPoll.FAILED
    assert _refused(waiting.failure_exception(), "draining: the server is draining")
    eventually(lambda: mooncake.decode._refusals.delivered == 2, "both refusals delivered")
    later = mooncake.prefill.create_sender(addr, 12)
    assert later.poll() == KVPoll.FAILED
    assert _refused(later.failure_exception(), "invalid_request: max_new_tokens")


@pytest.mark.mooncake
def test_mooncake_a_refusal_of_another_dp_replicas_room_is_not_this_ranks() -> None:
    pool = make_pool()
    place = attrs.evolve(RankPlace.single(num_layers=pool.num_layers, kv_heads=pool.kv_heads),
                         dp_rank=1, dp_size=2)
    kv = MooncakeKVManager(pool, MetadataBuffers(4), place=place)
    try:
        kv.peer_refused(20, "replica 0's room")
        kv.peer_refused(21, "replica 1's room")
        assert kv.create_sender("127.0.0.1:1", 20).poll() == KVPoll.BOOTSTRAPPING
        mine = kv.create_sender("127.0.0.1:1", 21)
        assert mine.poll() == KVPoll.FAILED
        assert _refused(mine.failure_exception(), "replica 1's room")
    finally:
        kv.close()


@pytest.mark.mooncake
def test_mooncake_a_prefill_refusal_answers_decode_destinations(mooncake: Mooncake) -> None:
    addr = mooncake.bootstrap.address
    early = mooncake.decode.create_receiver(addr, 13)
    early.init()
    early.send_metadata([0, 1], 0)
    # The destination waits on prefill (no sender yet) until prefill refuses the room.
    mooncake.prefill.refuse(13, "draining: the server is draining (shutting down)")
    mooncake.prefill.refuse(14, "prompt_too_long: 9000 tokens exceed the KV pool")
    late = mooncake.decode.create_receiver(addr, 14)
    late.init()
    late.send_metadata([2], 1)
    for receiver, why in ((early, "draining"), (late, "prompt_too_long")):
        eventually(lambda r=receiver: r.poll() == KVPoll.FAILED, f"room {receiver.room} failed")
        assert _refused(receiver.failure_exception(), why)
        assert receiver.quiescent()


@pytest.mark.mooncake
def test_mooncake_a_receiver_waiting_for_pages_learns_of_a_prefill_refusal_at_once() -> None:
    """A receiver that holds its room but sent no destination watches it (``Watch``): it
    fails as soon as prefill refuses the room or fails it before its destination, for every
    cause the local backend covers and the bootstrap timeout (found by the listener: nobody
    polls that sender), and nothing is answered twice (no message dropped on either side)."""
    clock = FakeClock()
    # A timeout shorter than a decode session's silence limit (30 s on this clock).
    mooncake = Mooncake(clock, MooncakeConfig(bootstrap_timeout_s=5.0))
    try:
        addr, prefill, decode = mooncake.bootstrap.address, mooncake.prefill, mooncake.decode
        prefill.refuse(40, "prompt_too_long (400): 9000 tokens")
        receivers = {room: decode.create_receiver(addr, room) for room in range(40, 45)}
        senders = {room: prefill.create_sender(addr, room) for room in (42, 43, 44)}
        for receiver in receivers.values():
            receiver.init()
        eventually(lambda: receivers[40].poll() == KVPoll.FAILED, "the refusal before the watch")
        eventually(lambda: prefill.watched_rooms() == [41, 42, 43, 44], "the other watches")
        prefill.refuse(41, "draining (503): the server is draining")
        senders[42].abort("rejected (400): the grammar engine cannot run this grammar")
        senders[43].abort()
        clock.now += prefill.config.bootstrap_timeout_s
        for room, why in ((40, "prompt_too_long (400)"), (41, "draining (503)"),
                          (42, "rejected (400)"), (43, "aborted"),
                          (44, "no destination from decode")):
            eventually(lambda r=receivers[room]: r.poll() == KVPoll.FAILED, f"room {room}")
            assert _refused(receivers[room].failure_exception(), why)
            assert receivers[room].quiescent()
        assert senders[44].poll() == KVPoll.FAILED
        assert senders[44].failure_exception().timeout
        for end in [*receivers.values(), *senders.values()]:
            end.clear()
        assert decode.live_rooms() == prefill.live_rooms() == 0
        assert prefill.watched_rooms() == []
        assert decode.dropped_messages.total == prefill.dropped_messages.total == 0
    finally:
        mooncake.close()


@pytest.mark.mooncake
def test_mooncake_a_destination_that_crossed_the_watchs_failure_is_not_answered_again(
    mooncake: Mooncake,
) -> None:
    """The decode rank sent its destination before the failure its watch was owed reached
    it: prefill does not answer the destination with the failure a second time."""
    addr, decode = mooncake.bootstrap.address, mooncake.decode
    crossed = decode.create_receiver(addr, 50)
    crossed.init()
    eventually(lambda: mooncake.prefill.watched_rooms() == [50], "the watch")
    mooncake.prefill.refuse(50, "draining (503): the server is draining")
    eventually(lambda: crossed.poll() == KVPoll.FAILED, "the watch's failure")
    # The destination it would have sent had the failure come a moment later.
    decode._peers.send_all(wire.Destination(50, decode.session, np.arange(2), 0))
    # Statuses from a prefill rank come in order: room 51's comes after any answer to 50's.
    mooncake.prefill.refuse(51, "draining (503): the server is draining")
    after = decode.create_receiver(addr, 51)
    after.init()
    eventually(lambda: after.poll() == KVPoll.FAILED, "room 51's refusal")
    assert decode.dropped_messages.total == 0
    assert mooncake.prefill.dropped_messages.total == 0


class _BeforeWatches(BootstrapServer):
    """The bootstrap endpoint of a prefill server that predates the ``Watch`` message: its
    table does not say ``watch``."""

    def _table(self) -> tuple[int, Any]:
        status, table = super()._table()
        if status == 200:
            del table["watch"]
        return status, table


@pytest.mark.mooncake
def test_mooncake_a_prefill_that_predates_watches_is_sent_none() -> None:
    """Decode sends no ``Watch`` to a prefill server whose table does not offer it (an older
    one would drop it as an unknown message): the refusal answers the destination instead,
    once decode has pages, as before watches."""
    server = _BeforeWatches()
    prefill = MooncakeKVManager(make_pool(), MetadataBuffers(4))
    prefill.register_to_bootstrap(server.address)
    decode = MooncakeDecodeManager(make_pool(), MetadataBuffers(4), server.address)
    try:
        assert not decode.prefill.watch
        waiting = decode.create_receiver(server.address, 60)
        waiting.init()
        prefill.refuse(60, "draining (503): the server is draining")
        after = decode.create_receiver(server.address, 61)  # a round trip after room 60's
        after.init()
        after.send_metadata([0], 0)
        prefill.refuse(61, "draining (503): the server is draining")
        eventually(lambda: after.poll() == KVPoll.FAILED, "room 61's refusal")
        assert waiting.poll() == KVPoll.WAITING_FOR_INPUT and prefill.watched_rooms() == []
        waiting.send_metadata([1], 1)
        eventually(lambda: waiting.poll() == KVPoll.FAILED, "the refusal, at the destination")
        assert _refused(waiting.failure_exception(), "draining (503)")
        assert prefill.dropped_messages.total == 0
    finally:
        decode.close()
        prefill.close()
        server.close()


class _Prefill:
    """A prefill server (bootstrap endpoint and one rank) that can be started again on the
    same port, with metadata rows of ``hidden`` (a draft's hand-off) or plain ones."""

    def __init__(self, hidden: int, port: int = 0) -> None:
        self.bootstrap = BootstrapServer(port=port)
        self.port = int(self.bootstrap.address.rpartition(":")[2])
        self.kv = MooncakeKVManager(make_pool(), MetadataBuffers(4, speculative_hidden=hidden))
        self.kv.register_to_bootstrap(self.bootstrap.address)
        self.bootstrap.add_refusal_listener(self.kv.peer_refused)

    def close(self) -> None:
        self.kv.close()
        self.bootstrap.close()


@pytest.mark.mooncake
def test_mooncake_a_decode_rank_prefill_cannot_pair_with_fails_its_rooms_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A prefill rank drops a ``Register`` it cannot pair with, here metadata rows of another
    layout, which the bootstrap table does not show (a worker of another pdlife version). It
    tells the decode rank why (``Refused``): decode's rooms for that prefill fail at once,
    later ones too, and their prefill halves are refused to the prefill instead of waiting for
    its bootstrap timeout; decode does not register with that instance again, and pairs with
    the compatible one started after it."""
    prefill = _Prefill(hidden=0)
    addr = prefill.bootstrap.address
    config = MooncakeConfig(heartbeat_interval_s=0.05, heartbeat_max_failures=2)
    decode = MooncakeDecodeManager(make_pool(), MetadataBuffers(4, speculative_hidden=8), addr,
                                   config=config)
    try:
        eventually(lambda: decode.lost is not None, "the refusal")
        lost = decode.lost
        assert lost is not None and "cannot pair with this decode rank: incompatible_layout: " \
            "(page_size, kv_dtype, kv_layout, metadata item lens)" in lost, lost
        assert lost.endswith("))"), lost  # both sides' values, whole
        # Logged on the heartbeat's thread just after the verdict is set: waited for too.
        eventually(lambda: any(r.levelno == logging.ERROR and "cannot pair" in r.getMessage()
                               for r in caplog.records), "the refusal logged")
        sender = prefill.kv.create_sender(addr, 7)
        receiver = decode.create_receiver(addr, 7)
        assert receiver.poll() == KVPoll.FAILED and receiver.quiescent()
        assert "incompatible_layout" in receiver.failure_exception().reason
        receiver.clear()
        eventually(lambda: sender.poll() == KVPoll.FAILED, "the prefill half refused")
        assert _refused(sender.failure_exception(), f"prefill {addr} (rank 0) cannot pair")
        sender.clear()
        # Refused once: the heartbeat that refused room 7 sent no keepalive to that instance.
        assert prefill.kv.dropped_messages.snapshot() == {"incompatible_layout": 1}

        prefill.close()
        prefill = _Prefill(hidden=8, port=prefill.port)  # another instance, compatible
        eventually(lambda: decode.lost is None, "registered with the new instance")
        sender = prefill.kv.create_sender(addr, 8)
        receiver = decode.create_receiver(addr, 8)
        receiver.init()
        receiver.send_metadata([0], 0)
        assert drive(prefill.kv, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == \
            KVPoll.WAITING_FOR_INPUT
        sender.abort()
        eventually(lambda: receiver.poll() == KVPoll.FAILED, "the abort")
        for end in (sender, receiver):
            eventually(end.quiescent, "quiescent")
            end.clear()
        assert prefill.kv.dropped_messages.total == decode.dropped_messages.total == 0

        # A refusal from a rank the prefill's table does not hold is dropped.
        forged = push_socket(zmq.Context.instance(), decode._control.endpoint)
        try:
            forged.send(wire.encode(wire.Refused("incompatible_model: forged", 5)))
            eventually(lambda: decode.dropped_messages.snapshot() == {"not_a_contact": 1},
                       "the forged refusal dropped")
        finally:
            forged.close()
        assert decode.lost is None
    finally:
        decode.close()
        prefill.close()


@pytest.mark.mooncake
def test_mooncake_bad_refusals_are_refused_by_the_bootstrap(mooncake: Mooncake) -> None:
    client = BootstrapClient(mooncake.bootstrap.address)
    for room in (-1, 1 << 64, True):
        with pytest.raises(BootstrapError, match="room must be a uint64"):
            client._request("POST", "/refusal", f'{{"room": {str(room).lower()}, '
                                                '"reason": "x"}'.encode())
    with pytest.raises(BootstrapError, match="400"):
        client._request("POST", "/refusal", b'{"room": 1}')
    with pytest.raises(BootstrapError, match="404"):
        client._request("POST", "/route", b"{}")


# -- a prefill scheduler and a decode peer, stepped together -----------------------------------


class Pair:
    """An embedded pair (local backend) on a clock that never moves: no timeout can fire."""

    def __init__(self, prefill_pages: int, decode_pages: int,
                 backend: Literal["local", "mooncake"] = "local") -> None:
        self.clock = FakeClock()
        self.pair = EmbeddedPair(
            PairConfig(model=ModelConfig.tiny(), prefill_pages=prefill_pages,
                       decode_pages=decode_pages, backend=backend,
                       scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=16)),
            clock=self.clock,
        )

    def send(self, rid: str, room: int, prompt: int, new_tokens: int, *,
             prefill: bool = True, decode: bool = True) -> None:
        new = NewRequest(rid, tuple(i % 200 for i in range(prompt)),
                         bootstrap_host=self.pair.bootstrap_host,
                         bootstrap_port=self.pair.bootstrap_port, bootstrap_room=room,
                         sampling=SamplingParams(new_tokens, (), True))
        if prefill:
            self.pair.prefill.submit(new)
        if decode:
            self.pair.decode.submit(new)

    def run(self, rids: list[str]) -> None:
        p, d = self.pair.prefill_responses, self.pair.decode_responses
        step_until(self.pair.step, lambda: all(r in p and r in d for r in rids), 30,
                   lambda: f"unanswered: prefill {set(rids) - set(p)}, decode {set(rids) - set(d)}")

    def refusals(self, side: str, direction: str) -> float:
        metrics = self.pair.prefill.metrics if side == "prefill" else self.pair.decode.metrics
        name = "pdlife_peer_refusals_total" if side == "prefill" else (
            "pdlife_decode_peer_refusals_total")
        value = metrics.registry.get_sample_value(name, {"direction": direction})
        return value or 0.0


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair(prefill_pages=32, decode_pages=64)
    yield p
    p.pair.close()


@pytest.fixture(params=["local", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def either_pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """:func:`pair` on either backend."""
    p = Pair(prefill_pages=32, decode_pages=64, backend=request.param)
    yield p
    p.pair.close()


def test_a_request_decode_refuses_fails_on_prefill_at_once(pair: Pair) -> None:
    pair.send("too-long-for-decode", 21, prompt=100, new_tokens=200)  # 300 > 256 decode tokens
    pair.send("room-zero", 0, prompt=8, new_tokens=2)
    pair.run(["too-long-for-decode", "room-zero"])
    p, d = pair.pair.prefill_responses, pair.pair.decode_responses
    assert d["too-long-for-decode"].reason is FailureReason.REJECTED
    assert d["room-zero"].reason is FailureReason.REJECTED
    for rid, why in (("too-long-for-decode", "cannot fit the KV pool of the decode side"),
                     ("room-zero", "bootstrap_room must be non-zero")):
        assert (p[rid].state, p[rid].reason) == (PrefillState.FAILED,
                                                 FailureReason.BOOTSTRAP_FAILED), p[rid]
        assert "peer refused: " in p[rid].detail and why in p[rid].detail, p[rid].detail
    assert pair.refusals("decode", "sent") == 2 and pair.refusals("prefill", "received") == 2
    assert pair.pair.idle()


def test_a_request_prefill_refuses_fails_on_decode_at_once(pair: Pair) -> None:
    pair.send("too-long-for-prefill", 22, prompt=140, new_tokens=2)  # 140 > 128 prefill tokens
    pair.run(["too-long-for-prefill"])
    p, d = pair.pair.prefill_responses, pair.pair.decode_responses
    assert p["too-long-for-prefill"].reason is FailureReason.REJECTED
    answer = d["too-long-for-prefill"]
    assert (answer.state, answer.reason) == (DecodeState.FAILED, FailureReason.BOOTSTRAP_FAILED)
    assert "peer refused: the prompt has 140 tokens" in answer.detail, answer.detail
    assert pair.refusals("prefill", "sent") == 1 and pair.refusals("decode", "received") == 1
    assert pair.pair.idle()


def test_a_request_one_side_aborts_before_the_handshake_ends_as_an_abort_on_the_other(
    either_pair: Pair,
) -> None:
    """Each side gets its half first and gives it up (its client aborts) before the other half
    arrives; with Mooncake the decode half sent its destination already, and withdraws it."""
    pair = either_pair
    pair.send("prefill-only", 23, prompt=8, new_tokens=2, decode=False)
    pair.send("decode-only", 24, prompt=8, new_tokens=2, prefill=False)
    step_until(pair.pair.step, lambda: (
        (req := pair.pair.decode.lifecycle.get("decode-only")) is not None
        and req.state is DecodeState.RECEIVING), 30, lambda: "decode's destination sent")
    pair.pair.prefill.abort("prefill-only")
    pair.pair.decode.abort("decode-only")
    step_until(pair.pair.step, lambda: "prefill-only" in pair.pair.prefill_responses
               and "decode-only" in pair.pair.decode_responses, 30, lambda: "both aborted")
    pair.send("prefill-only", 23, prompt=8, new_tokens=2, prefill=False)
    pair.send("decode-only", 24, prompt=8, new_tokens=2, decode=False)
    pair.run(["prefill-only", "decode-only"])
    p, d = pair.pair.prefill_responses, pair.pair.decode_responses
    assert p["prefill-only"].reason is FailureReason.ABORTED
    assert d["decode-only"].reason is FailureReason.ABORTED
    # The other half ends as an abort too (a router would retry a failure, undoing the abort).
    late_decode, late_prefill = d["prefill-only"], p["decode-only"]
    assert late_decode.reason is FailureReason.ABORTED
    assert "peer refused: aborted (200): aborted by the client" in late_decode.detail, (
        late_decode.detail)
    assert late_prefill.reason is FailureReason.ABORTED
    # (With Mooncake the withdrawal may reach the prefill rank before or after its sender.)
    detail = late_prefill.detail
    assert detail.startswith("aborted by the decode peer (room 24: ") and (
        "aborted by the peer" in detail), detail
    assert pair.pair.idle()


def test_a_decode_half_whose_prefill_half_timed_out_is_told_of_the_timeout(
    either_pair: Pair,
) -> None:
    """The prefill half waited out its bootstrap timeout before the decode half came: the
    decode half fails at once, with that reason, not with "peer refused: aborted", which reads
    as a client's abort."""
    pair = either_pair
    pair.send("late", 28, prompt=8, new_tokens=2, decode=False)
    step_until(pair.pair.step, lambda: bool(pair.pair.prefill.lifecycle.in_state(
        PrefillState.BOOTSTRAPPING)), 30, lambda: "the prefill half bootstrapping")
    pair.clock.now += 301.0  # past its bootstrap timeout (300 s)
    step_until(pair.pair.step, lambda: "late" in pair.pair.prefill_responses, 30,
               lambda: "the prefill half timed out")
    assert pair.pair.prefill_responses["late"].reason is FailureReason.BOOTSTRAP_TIMEOUT
    pair.send("late", 28, prompt=8, new_tokens=2, prefill=False)
    pair.run(["late"])
    answer = pair.pair.decode_responses["late"]
    assert (answer.state, answer.reason) == (DecodeState.FAILED, FailureReason.BOOTSTRAP_FAILED)
    assert ("peer refused: bootstrap_timeout (500): no destination from the decode peer "
            "within 300 s") in answer.detail, answer.detail
    assert pair.pair.idle()


def test_a_request_prefill_refuses_fails_on_decode_at_once_while_it_waits_for_pages(
    pair: Pair,
) -> None:
    """Decode's pool is taken by requests whose KV has not come: the refused request waits for
    pages there, and fails as soon as prefill refuses it, not when pages free up."""
    held = ["held-1", "held-2"]
    for i, rid in enumerate(held):  # 30 of the 64 decode pages each; no prefill half
        pair.send(rid, 25 + i, prompt=100, new_tokens=20, prefill=False)
    step_until(pair.pair.step, lambda: len(
        pair.pair.decode.lifecycle.in_state(DecodeState.RECEIVING)) == 2, 30, lambda: "held")
    pair.send("too-long-for-prefill", 27, prompt=140, new_tokens=2)  # 140 > 128 prefill tokens
    pair.run(["too-long-for-prefill"])
    answer = pair.pair.decode_responses["too-long-for-prefill"]
    assert (answer.state, answer.reason) == (DecodeState.FAILED, FailureReason.BOOTSTRAP_FAILED)
    assert "peer refused: the prompt has 140 tokens" in answer.detail, answer.detail
    assert len(pair.pair.decode.lifecycle.in_state(DecodeState.RECEIVING)) == 2
    for rid in held:
        pair.pair.decode.abort(rid)
    step_until(pair.pair.step, pair.pair.idle, 30, lambda: "idle after the aborts")
