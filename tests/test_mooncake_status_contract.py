"""A Mooncake prefill rank answers every destination with exactly one ``Status``
(docs/backends.md, "What the schedulers count on"): a decode receiver's pages are freed only
once that answer came.

Each test walks one way a destination could go unanswered: a decode session forgotten as silent
(its socket closed before its rooms' statuses left; a listener of the prefill's own that stalled
and judged keepalives missing that were only unread), a destination dropped (evicted from the
early store, out of range, a second one, not from a decode rank the room serves), a room number
used again whose new destination came before its sender, a decode process restarted on the same
engine port, an ``Abort`` the prefill rank cannot match, and one that overtook its destination.
Some walk the room table itself (:class:`~kv.mooncake_rooms.PrefillRooms`, no sockets); elsewhere
a decode rank is either a real
:class:`~kv.mooncake_decode.MooncakeDecodeManager` or :class:`StatusDecode`, raw ZeroMQ sockets
that send its control messages and read the statuses it is sent. To show that no status came,
a test sends an ``Abort`` of a room never used, which is answered, and reads up to that answer:
the listener handles a session's messages in order and pushes its statuses on one socket.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import zmq

from kv import wire
from kv.bootstrap import BootstrapServer
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager
from kv.mooncake_engine import MooncakeConfig, serve_control
from kv.mooncake_rooms import AnsweredDrop, PrefillRooms, Repeated
from kv.mooncake_slices import target_of
from kv.rank_table import RankPlace
from kv.refusal import TTL_S
from kv.transfer import REASON_PEER_ABORTED, KVPoll
from lifecycle.testing import FakeClock
from tests.transfer_harness import TIMEOUT_S, drive, eventually, make_pool

pytestmark = pytest.mark.mooncake

_TERMINAL = {KVPoll.SUCCESS, KVPoll.FAILED}
TOKEN = "t0ken-0123456789abcdef"
#: Rooms no test uses otherwise: an Abort of one is answered, after whatever came before.
_PROBE_ROOMS = itertools.count(1_000_000)


class StatusDecode:
    """A decode rank's control messages on raw ZeroMQ sockets (no engine: writes to it fail),
    and the statuses it is sent, read from a status endpoint of its own."""

    def __init__(self, manager: MooncakeKVManager, *, session: str = "127.0.0.1:9",
                 keepalive_ms: int = 0, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(manager.endpoint)
        self.statuses = self.ctx.socket(zmq.PULL)
        self.statuses.setsockopt(zmq.LINGER, 0)
        port = self.statuses.bind_to_random_port("tcp://127.0.0.1")
        self.session = session
        pool = manager.pool
        infos = manager.metadata.buffer_infos()
        self.register = wire.Register(
            session=session, status_endpoint=f"tcp://127.0.0.1:{port}", kv_ptr=1 << 20,
            num_layers=pool.num_layers, num_pages=16, page_size=pool.page_size,
            page_bytes=pool.page_bytes // tp_size, kv_dtype="float32",
            meta_ptrs=tuple(1 << 30 for _ in infos),
            meta_item_lens=tuple(i.item_len for i in infos), num_slots=4,
            kv_heads=pool.kv_heads, head_dim=pool.head_dim, tp_rank=tp_rank, tp_size=tp_size,
            keepalive_ms=keepalive_ms,
        )

    def send(self, msg: wire.Message) -> None:
        self.sock.send(wire.encode(msg, TOKEN))

    def destination(self, room: int, pages: list[int], slot: int = 0) -> wire.Destination:
        return wire.Destination(room, self.session, np.array(pages), slot)

    def status(self, timeout_s: float = TIMEOUT_S) -> wire.Status:
        assert self.statuses.poll(int(timeout_s * 1000)), "no status came"
        msg = wire.decode(self.statuses.recv(), TOKEN)
        assert isinstance(msg, wire.Status)
        return msg

    def statuses_before_probe(self) -> list[wire.Status]:
        """Every status sent to this decode rank before the answer to an ``Abort`` of a room
        never used, sent now (this reads that answer too)."""
        probe = next(_PROBE_ROOMS)
        self.send(wire.Abort(probe, self.session))
        seen = []
        while (status := self.status()).room != probe:
            seen.append(status)
        assert status.poll == KVPoll.FAILED and status.reason == REASON_PEER_ABORTED
        return seen

    def close(self) -> None:
        self.sock.close()
        self.statuses.close()
        self.ctx.term()


def _manager(clock: FakeClock | None = None, **config: Any) -> MooncakeKVManager:
    return MooncakeKVManager(make_pool(), MetadataBuffers(8), clock=clock or FakeClock(),
                             config=MooncakeConfig(token=TOKEN, **config))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def manager(clock: FakeClock) -> Iterator[MooncakeKVManager]:
    mgr = _manager(clock, bootstrap_timeout_s=30.0)
    yield mgr
    mgr.close()


def _decode(manager: MooncakeKVManager, **kwargs: Any) -> StatusDecode:
    """A :class:`StatusDecode` registered with ``manager``."""
    decode = StatusDecode(manager, **kwargs)
    decode.send(decode.register)
    eventually(lambda: decode.session in manager.decode_sessions(), "registered")
    return decode


@pytest.fixture
def raw(manager: MooncakeKVManager) -> Iterator[StatusDecode]:
    decode = _decode(manager)
    yield decode
    decode.close()


def _dropped(manager: MooncakeKVManager, reason: str, count: int = 1) -> None:
    eventually(lambda: manager.dropped_messages.snapshot().get(reason, 0) >= count,
               f"{count} message(s) dropped as {reason}")


def _paired(manager: MooncakeKVManager, raw: StatusDecode, room: int) -> Any:
    sender = manager.create_sender("", room)
    raw.send(raw.destination(room, [1, 2]))
    assert drive(manager, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    return sender


def _polls(transfer: Any, state: KVPoll) -> Callable[[], bool]:
    """Whether ``transfer`` polls ``state`` now."""
    return lambda: bool(transfer.poll() == state)


def _wait_ready(manager: MooncakeKVManager, room: int) -> None:
    """Wait until ``room`` comes off ``manager.ready`` (the others that come are dropped)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            if manager.ready.get(timeout=max(0.0, deadline - time.monotonic())) == room:
                return
        except queue.Empty:
            raise AssertionError(f"room {room} was not pushed onto ready") from None


# -- a forgotten decode session ----------------------------------------------------------------


def test_a_session_forgotten_as_silent_hears_its_rooms_failed_and_frees_their_pages() -> None:
    """A decode rank paused past its silence limit is forgotten with its rooms; the FAILED
    status of each leaves before its socket closes, so its receivers are quiescent (their pages
    go back) instead of waiting for a status for as long as the prefill stays up."""
    clock = FakeClock()
    server = BootstrapServer()
    prefill = MooncakeKVManager(make_pool(), MetadataBuffers(8), clock=clock)
    prefill.register_to_bootstrap(server.address)
    # A keepalive every hour: none comes while the test runs.
    decode = MooncakeDecodeManager(make_pool(), MetadataBuffers(8), server.address,
                                   config=MooncakeConfig(heartbeat_interval_s=3600))
    try:
        eventually(lambda: prefill.decode_sessions() == [decode.session], "registered")
        receiver = decode.create_receiver(server.address, 77)
        receiver.init()
        receiver.send_metadata([0, 1], slot=0)
        sender = prefill.create_sender(server.address, 77)
        assert drive(prefill, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
        clock.now += 6 * 3600 + 1
        assert prefill.forget_silent() == [decode.session]
        assert drive(prefill, sender, _TERMINAL)[-1] == KVPoll.FAILED
        eventually(lambda: receiver.poll() == KVPoll.FAILED and receiver.quiescent(),
                   "the decode receiver failed and quiescent")
        assert "went silent: no keepalive for 21601 s" in receiver.failure_exception().reason
        assert prefill.dropped_messages.total == 0
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_a_listener_that_stalled_reads_the_keepalives_before_it_judges_silence(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The prefill's own listener, not run for a minute (a long pause of the process), must
    not forget a decode session whose keepalives queued unread meanwhile: its late tick judges
    no one, and the keepalive read after it keeps the session and its room. Ticks on time judge
    as before: a session silent past its limit is forgotten by the listener, and its room's
    FAILED status reaches it."""
    clock = FakeClock()
    manager = _manager(clock, bootstrap_timeout_s=1.5)  # each tick shows as a probe's timeout
    raw = _decode(manager, keepalive_ms=1000)  # silent past 30 s: forgotten
    probes = iter(range(100, 200))

    def tick_after(seconds: float) -> None:
        """Advance the clock and wait for the listener's tick at the new time."""
        probe = manager.create_sender("", next(probes))
        clock.now += seconds
        _wait_ready(manager, probe.room)  # its bootstrap timeout, failed by the tick

    try:
        paired = _paired(manager, raw, 1)
        tick_after(61)  # a stall of the listener's own: the keepalives wait unread
        raw.send(raw.register)  # the keepalive read once it runs again
        eventually(lambda: manager.last_heard(raw.session) == clock.now, "the keepalive")
        assert paired.poll() == KVPoll.WAITING_FOR_INPUT
        assert manager.decode_sessions() == [raw.session]
        assert "did not run for 61 s" in caplog.text
        for _ in range(15):  # 30 s of ticks on time, without a keepalive
            tick_after(2)
            assert manager.decode_sessions() == [raw.session]
        tick_after(2)
        eventually(lambda: manager.decode_sessions() == [], "the silent session forgotten")
        assert drive(manager, paired, _TERMINAL)[-1] == KVPoll.FAILED
        status = raw.status()
        assert (status.room, status.poll) == (1, KVPoll.FAILED)
        assert status.reason == f"decode session {raw.session} went silent: no keepalive for 32 s"
    finally:
        raw.close()
        manager.close()


def test_the_listener_handles_every_message_waiting_before_its_periodic_work() -> None:
    """What the tick judges from the messages (a keepalive that did not come) it judges after
    every message that was waiting: the listener reads them all before it ticks."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://control")
    push.connect("inproc://control")
    stop = threading.Event()
    handled: list[wire.Message] = []
    seen_at_tick: list[int] = []

    def tick() -> None:
        seen_at_tick.append(len(handled))
        stop.set()

    try:
        for room in range(3):
            push.send(wire.encode(wire.Abort(room, "127.0.0.1:9")))
        serve_control(pull, stop, None, handled.append, wire.DroppedMessages(),
                      logging.getLogger(__name__), tick)
        assert seen_at_tick == [3]
        assert [m.room for m in handled if isinstance(m, wire.Abort)] == [0, 1, 2]
    finally:
        pull.close()
        push.close()
        ctx.term()


# -- dropped destinations ------------------------------------------------------------------------


def test_an_early_destination_evicted_is_answered_and_its_room_fails_on_both_sides() -> None:
    """The early store holds one room here: the second room's destination evicts the first's,
    which is answered (its decode receiver fails and is quiescent), and a sender created for
    the evicted room fails at once rather than at its bootstrap timeout."""
    server = BootstrapServer()
    prefill = MooncakeKVManager(make_pool(), MetadataBuffers(8),
                                config=MooncakeConfig(max_early_destinations=1))
    prefill.register_to_bootstrap(server.address)
    decode = MooncakeDecodeManager(make_pool(), MetadataBuffers(8), server.address)
    try:
        eventually(lambda: prefill.decode_sessions() == [decode.session], "registered")
        receivers = {}
        for slot, room in enumerate((11, 12)):  # decode has pages before prefill admits either
            receivers[room] = decode.create_receiver(server.address, room)
            receivers[room].init()
            receivers[room].send_metadata([2 * slot, 2 * slot + 1], slot=slot)
        evicted = receivers[11]
        eventually(lambda: evicted.poll() == KVPoll.FAILED and evicted.quiescent(),
                   "the evicted room failed and quiescent on decode")
        assert "early_overflow" in evicted.failure_exception().reason
        assert prefill.dropped_messages.snapshot() == {"early_overflow": 1}
        late = prefill.create_sender(server.address, 11)
        assert late.poll() == KVPoll.FAILED and late.quiescent()
        assert "early_overflow" in late.failure_exception().reason
        assert not late.failure_exception().refused  # this rank's own limit
        kept = prefill.create_sender(server.address, 12)
        assert drive(prefill, kept, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
        assert receivers[12].poll() != KVPoll.FAILED
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_a_destination_that_does_not_fit_its_registration_is_answered(
    manager: MooncakeKVManager, raw: StatusDecode
) -> None:
    sender = manager.create_sender("", 5)
    raw.send(raw.destination(5, [3, 16]))  # the decode pool registered 16 pages
    status = raw.status()
    assert (status.room, status.poll) == (5, KVPoll.FAILED)
    assert status.reason.startswith("destination dropped: page_out_of_range: room 5: pages")
    raw.send(raw.destination(5, [0, 1], slot=4))  # and 4 slots
    assert raw.status().reason.startswith("destination dropped: slot_out_of_range")
    _dropped(manager, "slot_out_of_range")  # counted once answered
    assert manager.dropped_messages.snapshot() == {"page_out_of_range": 1,
                                                   "slot_out_of_range": 1}
    assert sender.poll() == KVPoll.BOOTSTRAPPING
    raw.send(raw.destination(5, [0, 15]))
    assert drive(manager, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    assert raw.statuses_before_probe() == []


def test_a_second_destination_is_answered_unless_its_session_holds_the_first(
    manager: MooncakeKVManager, raw: StatusDecode
) -> None:
    """Another decode process's destination for a room already paired (a request sent to two
    decode servers) is answered: nothing writes into it. A second one from the session whose
    destination the room holds is not: its answer is the room's own, when it concludes."""
    other = _decode(manager, session="127.0.0.1:10")
    try:
        sender = _paired(manager, raw, 3)
        other.send(other.destination(3, [4, 5]))
        status = other.status()
        assert (status.room, status.poll) == (3, KVPoll.FAILED)
        assert status.reason == "destination dropped: duplicate_destination: room 3"
        raw.send(raw.destination(3, [6, 7]))
        _dropped(manager, "duplicate_destination", 2)
        assert raw.statuses_before_probe() == []
        assert sender.poll() == KVPoll.WAITING_FOR_INPUT
        sender.abort()  # the room's own answer, to the session it holds
        status = raw.status()
        assert (status.room, status.poll) == (3, KVPoll.FAILED)
        assert other.statuses_before_probe() == []
    finally:
        other.close()


def test_a_destination_from_a_decode_rank_the_room_does_not_serve_is_answered(
    manager: MooncakeKVManager, raw: StatusDecode
) -> None:
    """A room waits for the decode ranks of one TP layout (those of its first destination); a
    destination from a decode rank of another is answered, whether it came to the live room
    or early, before the room's sender existed."""
    tp2 = _decode(manager, session="127.0.0.1:11", tp_size=2)
    try:
        live = manager.create_sender("", 7)
        tp2.send(tp2.destination(7, [1, 2]))  # the room now waits for decode ranks (0, 1)
        assert tp2.statuses_before_probe() == []  # taken, before the other session's
        raw.send(raw.destination(7, [3, 4]))
        status = raw.status()
        assert (status.room, status.poll) == (7, KVPoll.FAILED)
        assert status.reason.startswith("destination dropped: not_a_contact: room 7")
        assert live.poll() == KVPoll.BOOTSTRAPPING
        tp2.send(tp2.destination(8, [1, 2]))
        assert tp2.statuses_before_probe() == []  # kept, before the other session's
        raw.send(raw.destination(8, [3, 4]))
        assert raw.statuses_before_probe() == []  # kept, until the room's sender exists
        manager.create_sender("", 8)
        status = raw.status()
        assert (status.room, status.poll) == (8, KVPoll.FAILED)
        assert status.reason.startswith("destination dropped: not_a_contact: room 8")
        assert tp2.statuses_before_probe() == []
    finally:
        tp2.close()


# -- room reuse ----------------------------------------------------------------------------------


def test_a_room_number_used_again_takes_its_destination_before_its_sender() -> None:
    """Room numbers are reused once both sides cleared them: the next use's destination,
    arriving before its sender exists (the usual order), waits for it as any early one."""
    server = BootstrapServer()
    metadata = MetadataBuffers(8)
    prefill = MooncakeKVManager(make_pool(), metadata)
    prefill.register_to_bootstrap(server.address)
    decode = MooncakeDecodeManager(make_pool(), MetadataBuffers(8), server.address)
    pages = prefill.pool.allocator.alloc(2)
    assert pages is not None
    try:
        for use, slot in enumerate((0, 1)):
            # Decode has pages first (its watch, then its destination reach the prefill rank),
            # then the prefill rank admits the request.
            receiver = decode.create_receiver(server.address, 9)
            receiver.init()
            eventually(lambda: prefill.watched_rooms() == [9], "decode's watch")
            receiver.send_metadata([2 * use, 2 * use + 1], slot)
            eventually(lambda: prefill.watched_rooms() == [], "decode's destination")
            sender = prefill.create_sender(server.address, 9)
            assert drive(prefill, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == (
                KVPoll.WAITING_FOR_INPUT)
            sender.init(2, slot)
            metadata.write(slot, first_token=1, cached_tokens=0, logprob=None, room=9)
            sender.send(pages, last=True)
            assert drive(prefill, sender, _TERMINAL)[-1] == KVPoll.SUCCESS
            eventually(_polls(receiver, KVPoll.SUCCESS), "decode's success")
            eventually(sender.quiescent, "the sender quiescent")
            sender.clear()
            receiver.clear()
        assert prefill.dropped_messages.total == 0
    finally:
        decode.close()
        prefill.close()
        server.close()


# -- aborts -----------------------------------------------------------------------------------


def test_an_abort_is_answered_once_for_every_destination(
    manager: MooncakeKVManager, raw: StatusDecode
) -> None:
    """An abort the rank cannot match (a room it never had, one whose destination it dropped)
    is answered; one that came after the room's status is answered with that status again,
    marked ``again`` (the first may have been lost on the way); and one for a room whose status
    could not be sent (the session had left) is answered once it is back."""
    raw.send(wire.Abort(41, raw.session))  # a destination this rank never had
    status = raw.status()
    assert (status.room, status.poll, status.reason) == (41, KVPoll.FAILED, REASON_PEER_ABORTED)

    first = _paired(manager, raw, 42)
    first.abort()
    told = raw.status()
    assert (told.room, told.again, first.quiescent()) == (42, False, True)
    first.clear()
    raw.send(wire.Abort(42, raw.session))  # decode's abort, which crossed that status
    again = raw.status()
    assert again == wire.Status(42, told.poll, told.reason, told.rank, again=True)
    assert raw.statuses_before_probe() == []
    assert manager.dropped_messages.total == 0

    left = _paired(manager, raw, 43)
    raw.send(wire.Deregister(raw.session))  # it reads no more: its room's status is not sent
    eventually(lambda: manager.decode_sessions() == [], "the session forgotten")
    assert drive(manager, left, _TERMINAL)[-1] == KVPoll.FAILED
    raw.send(wire.Abort(43, raw.session))
    _dropped(manager, "unknown_session")
    raw.send(raw.register)
    eventually(lambda: manager.decode_sessions() == [raw.session], "registered again")
    assert raw.statuses_before_probe() == []
    raw.send(wire.Abort(43, raw.session))
    status = raw.status()
    assert (status.room, status.poll) == (43, KVPoll.FAILED)
    assert raw.statuses_before_probe() == []


def test_clearing_a_room_that_has_not_concluded_tells_decode(
    manager: MooncakeKVManager, raw: StatusDecode
) -> None:
    sender = _paired(manager, raw, 44)
    sender.clear()  # without an abort first: the destination is still answered
    status = raw.status()
    assert (status.room, status.poll) == (44, KVPoll.FAILED)


# -- a decode process restarted on the same engine port ---------------------------------------


def test_a_changed_registration_fails_the_rooms_of_the_earlier_one(
    manager: MooncakeKVManager, raw: StatusDecode
) -> None:
    """A ``Register`` unlike the one held for the session is another decode process on its
    engine port: the earlier registration's rooms fail (their chunks would land in the new
    process's memory) and its early destinations are dropped, each answered on the earlier
    status endpoint; the new registration serves the rooms that come after."""
    paired = _paired(manager, raw, 3)
    raw.send(raw.destination(4, [5, 6], slot=1))  # before room 4's sender exists
    assert raw.statuses_before_probe() == []  # kept
    restarted = StatusDecode(manager)
    try:
        restarted.register = attrs.evolve(restarted.register, kv_ptr=1 << 40)
        restarted.send(restarted.register)
        assert drive(manager, paired, _TERMINAL)[-1] == KVPoll.FAILED
        assert "registered anew" in paired.failure_exception().reason
        told = {raw.status().room, raw.status().room}
        assert told == {3, 4}
        early = manager.create_sender("", 4)
        assert early.poll() == KVPoll.FAILED and "registered anew" in (
            early.failure_exception().reason)
        eventually(lambda: manager.decode_sessions() == [raw.session], "registered anew")
        later = _paired(manager, restarted, 5)
        later.abort()
        status = restarted.status()
        assert (status.room, status.poll) == (5, KVPoll.FAILED)
        assert restarted.statuses_before_probe() == []
    finally:
        restarted.close()


# -- closing ------------------------------------------------------------------------------------


def test_closing_fails_the_live_rooms_and_every_sender_is_quiescent() -> None:
    manager = _manager(bootstrap_timeout_s=30.0)
    raw = _decode(manager)
    try:
        live = _paired(manager, raw, 1)
        live.init(2, 0)
        waiting = manager.create_sender("", 2)
    except BaseException:
        manager.close()
        raw.close()
        raise
    manager.close()
    try:
        for sender in (live, waiting):
            assert sender.poll() == KVPoll.FAILED and sender.quiescent()
            assert sender.failure_exception().reason == "the prefill manager closed"
        pages = manager.pool.allocator.alloc(2)
        assert pages is not None
        live.send(pages, last=True)  # ignored: the room failed
        assert live.quiescent()
        late = manager.create_sender("", 3)
        assert late.poll() == KVPoll.FAILED and late.quiescent()
    finally:
        raw.close()


# -- the room table itself ----------------------------------------------------------------------


S, S2 = "127.0.0.1:9", "127.0.0.1:10"


def _table(clock: FakeClock, sessions: tuple[str, ...] = (S,), *,
           max_early_destinations: int = 16) -> PrefillRooms:
    """A room table with ``sessions`` registered (decode ranks of one TP layout)."""
    rooms = PrefillRooms(num_slots=8, bootstrap_timeout_s=30.0,
                         max_early_destinations=max_early_destinations, clock=clock)
    pool = make_pool()
    place = RankPlace.single(num_layers=pool.num_layers, kv_heads=pool.kv_heads)
    infos = MetadataBuffers(8).buffer_infos()
    for port, session in enumerate(sessions, start=44401):
        reg = wire.Register(
            session=session, status_endpoint=f"tcp://127.0.0.1:{port}", kv_ptr=1 << 20,
            num_layers=pool.num_layers, num_pages=16, page_size=pool.page_size,
            page_bytes=pool.page_bytes, kv_dtype="float32",
            meta_ptrs=tuple(1 << 30 for _ in infos),
            meta_item_lens=tuple(i.item_len for i in infos), num_slots=4,
            kv_heads=pool.kv_heads, head_dim=pool.head_dim, tp_rank=0, tp_size=1,
            keepalive_ms=0)
        rooms.register(target_of(pool, place, reg))
    return rooms


def _dest(room: int, pages: list[int], session: str = S) -> wire.Destination:
    return wire.Destination(room, session, np.array(pages), 0)


def _failed(session: str, room: int, reason: str) -> tuple[str, int, KVPoll, str]:
    return (session, room, KVPoll.FAILED, reason)


def _as_tuples(owed: list[Any]) -> list[tuple[str, int, KVPoll, str]]:
    return [(o.session, o.room, o.poll, o.reason) for o in owed]


def _answered_drop(rooms: PrefillRooms, dest: wire.Destination) -> AnsweredDrop:
    with pytest.raises(AnsweredDrop) as drop:
        rooms.destination(dest)
    return drop.value


def test_an_abort_that_overtook_its_destination_fails_the_room_waiting_for_it() -> None:
    """Decode may send a room's ``Abort`` ahead of its destination (another connection, another
    thread): the abort is answered, so decode frees the pages; the room waiting for that
    destination fails at once, and the destination, when it comes, is answered and never
    written into, also once a later use of the room number waits for its own."""
    clock = FakeClock()
    rooms = _table(clock)
    rec, _ = rooms.create(5)
    assert _as_tuples(rooms.peer_abort(wire.Abort(5, S))) == [
        _failed(S, 5, REASON_PEER_ABORTED)]
    assert (rec.status, rec.reason) == (KVPoll.FAILED, REASON_PEER_ABORTED)
    drop = _answered_drop(rooms, _dest(5, [1, 2]))
    assert drop.reason == "stale_room"
    assert [(o.session, o.room, o.poll) for o in drop.owed] == [(S, 5, KVPoll.FAILED)]
    assert drop.owed[0].reason.startswith("destination dropped: stale_room: room 5: session")
    assert rec.legs == {} and not rec.paired
    assert rooms.clear(rec) == []
    # Another came after the answers: the last one again (the first may have been lost).
    (repeat,) = rooms.peer_abort(wire.Abort(5, S))
    assert isinstance(repeat, Repeated) and _as_tuples([repeat]) == _as_tuples(drop.owed)

    # The same, with the room cleared and its number used again before the destination came.
    first, _ = rooms.create(6)
    rooms.peer_abort(wire.Abort(6, S))
    rooms.clear(first)
    again, _ = rooms.create(6)
    assert _answered_drop(rooms, _dest(6, [1, 2])).owed[0].room == 6
    assert again.legs == {} and again.status == KVPoll.BOOTSTRAPPING
    rooms.destination(_dest(6, [3, 4]))  # the new use's own destination
    assert again.paired


def test_an_abort_that_overtook_its_destination_before_the_room_existed() -> None:
    """Before the room's sender exists: the abort is answered once, the destination that
    comes after it is answered and not kept, and the room fails as soon as it is created,
    with nothing more owed to the session."""
    clock = FakeClock()
    rooms = _table(clock)
    assert _as_tuples(rooms.peer_abort(wire.Abort(6, S))) == [
        _failed(S, 6, REASON_PEER_ABORTED)]
    assert len(_answered_drop(rooms, _dest(6, [7])).owed) == 1
    rec, owed = rooms.create(6)
    assert owed == [] and rec.legs == {}
    assert (rec.status, rec.reason) == (KVPoll.FAILED, f"peer refused: {REASON_PEER_ABORTED}")
    (repeat,) = rooms.peer_abort(wire.Abort(6, S))  # the last answer again
    assert isinstance(repeat, Repeated) and repeat.reason.startswith("destination dropped:")


def test_an_abort_ahead_of_its_destination_is_remembered_for_a_while_only() -> None:
    """The withdrawal expires as the refusal records do: a destination that comes later is
    a later request's, kept for its sender as any early one."""
    clock = FakeClock()
    rooms = _table(clock)
    rooms.peer_abort(wire.Abort(7, S))
    clock.now += TTL_S + 1
    assert rooms.destination(_dest(7, [1, 2])) == []
    rec, owed = rooms.create(7)
    assert owed == [] and rec.paired and rec.status == KVPoll.WAITING_FOR_INPUT


def test_an_abort_ahead_of_its_destination_end_to_end(
    manager: MooncakeKVManager, raw: StatusDecode
) -> None:
    sender = manager.create_sender("", 8)
    raw.send(wire.Abort(8, raw.session))
    raw.send(raw.destination(8, [1, 2]))
    first, second = raw.status(), raw.status()
    assert (first.room, first.poll, first.reason) == (8, KVPoll.FAILED, REASON_PEER_ABORTED)
    assert (second.room, second.poll) == (8, KVPoll.FAILED)
    assert second.reason.startswith("destination dropped: stale_room")
    assert sender.poll() == KVPoll.FAILED
    assert sender.failure_exception().reason == REASON_PEER_ABORTED
    _dropped(manager, "stale_room")
    assert raw.statuses_before_probe() == []


def test_a_watching_session_whose_destination_is_dropped_is_answered_once() -> None:
    """The drop's answer ends the session's watch: the room's bootstrap timeout owes it
    nothing more."""
    clock = FakeClock()
    rooms = _table(clock)
    rec, _ = rooms.create(77)
    assert rooms.watch(wire.Watch(77, S)) == []
    drop = _answered_drop(rooms, _dest(77, [999]))
    assert drop.reason == "page_out_of_range" and len(drop.owed) == 1
    assert rooms.watched() == []
    clock.now += 31
    assert rooms.expire() == []
    assert rec.status == KVPoll.FAILED and rec.timed_out


def test_a_watching_session_whose_destination_is_dropped_end_to_end(
    manager: MooncakeKVManager, raw: StatusDecode
) -> None:
    manager.create_sender("", 78)
    raw.send(wire.Watch(78, raw.session))
    eventually(lambda: manager.watched_rooms() == [78], "the watch")
    raw.send(raw.destination(78, [3, 16]))  # out of the decode pool's 16 pages
    assert raw.status().reason.startswith("destination dropped: page_out_of_range")
    assert manager.watched_rooms() == []


def test_a_room_decode_refused_answers_a_destination_still_on_its_way() -> None:
    """Decode refused a room whose sender waits: the room fails; once it is cleared, a decode
    rank's destination still on its way is answered with that refusal (as decode's own, not a
    refusal of it) rather than kept for a later use of the room number, and a watch that comes
    is told nothing (decode ended the room itself)."""
    clock = FakeClock()
    rooms = _table(clock, (S, S2))
    rec, _ = rooms.create(9)
    assert rooms.peer_refused(9, "draining (503): shutting down") == []
    assert rec.status == KVPoll.FAILED
    assert rooms.clear(rec) == []
    assert _as_tuples(rooms.destination(_dest(9, [1, 2]))) == [
        _failed(S, 9, "peer refused: draining (503): shutting down")]
    assert rooms.watch(wire.Watch(9, S2)) == []
    again, owed = rooms.create(9)
    assert owed == [] and again.legs == {} and again.status == KVPoll.BOOTSTRAPPING


def test_an_early_overflow_fails_the_room_for_the_prefill_limit_and_tells_its_watchers() -> None:
    """The early store holds one room: the second room's destination evicts the first's. Its
    destination is answered, the decode rank watching it is told at once, and so is one that
    watches it later; its sender fails when created for this rank's limit, not as a decode
    refusal."""
    clock = FakeClock()
    rooms = _table(clock, (S, S2), max_early_destinations=1)
    assert rooms.watch(wire.Watch(1, S2)) == []
    assert rooms.destination(_dest(1, [1, 2])) == []
    drop = _answered_drop(rooms, _dest(2, [3, 4]))
    why = ("early_overflow: this prefill rank keeps the early destinations of at most 1 rooms "
           "(max_early_destinations); room 1's were dropped")
    assert drop.reason == "early_overflow"
    assert _as_tuples(drop.owed) == [_failed(S, 1, why), _failed(S2, 1, f"peer refused: {why}")]
    assert rooms.watched() == []
    assert _as_tuples(rooms.watch(wire.Watch(1, S2))) == [_failed(S2, 1, f"peer refused: {why}")]
    rec, owed = rooms.create(1)
    assert owed == []
    assert (rec.status, rec.reason) == (KVPoll.FAILED, why)
    assert not rooms.failure(rec).refused

