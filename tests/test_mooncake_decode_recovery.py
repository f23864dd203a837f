"""The Mooncake decode manager when things go wrong around it: a prefill lost while its ranks
may still write (its rooms are told to abort and held until a ``Status``, another instance, the
prefill saying it stopped writing, or the release bound), a metadata row that lands after its
``Status`` (the room is pushed again), and a construction that fails half-way (it closes what it
opened, the prefill manager's and the control endpoint's too).

The prefill is a real one where the end-to-end behaviour matters, else one rank played on raw
ZeroMQ sockets behind a real bootstrap endpoint (:class:`PlayedRank`), so a test chooses which
``Status`` comes and when. The heartbeat's verdicts are given by calling its check directly
(``_lose_prefill``, ``_wake``, ``_release_overdue``), never by waiting its interval out."""

from __future__ import annotations

import errno
import gc
import logging
import math
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import mooncake.engine
import pytest
import zmq

import kv.mooncake
import kv.mooncake_decode
import kv.mooncake_engine
import kv.mooncake_peers
from kv import wire
from kv.bootstrap import BootstrapClient, BootstrapError, BootstrapServer
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager
from kv.mooncake_engine import (
    LOST_RELEASE_TIMEOUT_S,
    ControlEndpoint,
    MooncakeConfig,
    MooncakeEngine,
    MooncakeError,
    kv_dtype_name,
)
from kv.pool import KVPool
from kv.rank_table import RankInfo, RankPlace
from kv.transfer import REASON_PEER_ABORTED, KVPoll
from tests.transfer_harness import TIMEOUT_S, drive, eventually, make_pool

pytestmark = pytest.mark.mooncake

_TERMINAL = {KVPoll.SUCCESS, KVPoll.FAILED}
#: The heartbeat never checks on its own in these tests: they call its check.
_NO_HEARTBEAT = MooncakeConfig(heartbeat_interval_s=3600)


def _rank_info(pool: KVPool, endpoint: str, *, rank: int = 0, dp_size: int = 1) -> RankInfo:
    """A prefill rank whose pool pairs with ``pool``, taking control messages at ``endpoint``
    (rank ``rank`` of ``dp_size`` DP replicas)."""
    place = RankPlace(dp_rank=rank, dp_size=dp_size, kv_heads=pool.kv_heads,
                      num_layers=pool.num_layers, layer_start=0, layer_stop=pool.num_layers)
    return RankInfo(rank=rank, endpoint=endpoint, session=f"127.0.0.1:{9 + rank}",
                    page_size=pool.page_size, kv_dtype=kv_dtype_name(pool), model=pool.model,
                    model_name=pool.model_name, kv_layout=pool.layout.value,
                    head_dim=pool.head_dim, place=place)


class PlayedRank:
    """One prefill rank played on raw ZeroMQ sockets (no engine) behind a real bootstrap
    endpoint on ``port`` (0: a free one): it reads what decode sends it, and sends decode the
    ``Status`` a test asks for."""

    def __init__(self, pool: KVPool, port: int = 0) -> None:
        self.server = BootstrapServer(port=port)
        self.address = self.server.address
        self.port = int(self.address.rpartition(":")[2])
        self.ctx: zmq.Context[Any] = zmq.Context()
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        control = self._pull.bind_to_random_port("tcp://127.0.0.1")
        self._push: zmq.Socket[Any] | None = None
        self._closed = False
        BootstrapClient(self.address).register(_rank_info(pool, f"tcp://127.0.0.1:{control}"))

    def received(self, count: int) -> list[tuple[str, int | None]]:
        """The next ``count`` messages from decode, as (type, room); a ``Register`` (re)opens
        the way back to decode's status endpoint."""
        got: list[tuple[str, int | None]] = []
        for _ in range(count):
            assert self._pull.poll(int(TIMEOUT_S * 1000)), f"only {got} came"
            msg = wire.decode(self._pull.recv(), None)
            if isinstance(msg, wire.Register) and self._push is None:
                self._push = self.ctx.socket(zmq.PUSH)
                self._push.setsockopt(zmq.LINGER, 0)
                self._push.connect(msg.status_endpoint)
            got.append((type(msg).__name__, getattr(msg, "room", None)))
        return got

    def nothing_queued(self) -> bool:
        return not self._pull.poll(0)

    def status(self, room: int, poll: KVPoll, reason: str = "", *, again: bool = False) -> None:
        assert self._push is not None, "no Register came"
        self._push.send(wire.encode(wire.Status(room, int(poll), reason, 0, again=again), None))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.server.close()
            self.ctx.destroy(linger=0)


@pytest.fixture
def played() -> Iterator[PlayedRank]:
    rank = PlayedRank(make_pool())
    yield rank
    rank.close()


def _decode(address: str, config: MooncakeConfig = _NO_HEARTBEAT) -> MooncakeDecodeManager:
    return MooncakeDecodeManager(make_pool(), MetadataBuffers(8), address, config=config)


class Pushed:
    """What a manager pushed to its ``ready`` queue, gathered as a test waits for it."""

    def __init__(self, decode: MooncakeDecodeManager) -> None:
        self._ready = decode.ready
        self.rooms: list[int] = []

    def take(self) -> list[int]:
        """Everything pushed since the last take."""
        while True:
            try:
                self.rooms.append(self._ready.get_nowait())
            except queue.Empty:
                taken, self.rooms = self.rooms, []
                return taken

    def wait_for(self, room: int) -> None:
        try:
            while self._ready.get(timeout=TIMEOUT_S) != room:
                pass
        except queue.Empty:
            raise AssertionError(f"room {room} was not pushed to ready") from None


def _held_room(played: PlayedRank, decode: MooncakeDecodeManager, room: int = 5
               ) -> kv.mooncake_decode.MooncakeKVReceiver:
    """A receiver whose destination reached the played rank, and the prefill then lost while
    that rank answered nothing: failed, told to abort, held."""
    rx = decode.create_receiver(played.address, room)
    rx.init()
    rx.send_metadata([0, 1], 0)
    assert played.received(3) == [("Register", None), ("Watch", room), ("Destination", room)]
    decode._lose_prefill(f"lost contact with prefill {played.address}")
    assert played.received(1) == [("Abort", room)]
    assert rx.poll() == KVPoll.FAILED and not rx.quiescent()
    return rx


# -- a Status repeated in answer to an Abort ---------------------------------------------------


@pytest.mark.parametrize("then", ["nothing", "held_anew", "held_anew_and_aborted"])
def test_a_repeated_status_is_for_the_use_that_aborted_and_never_a_later_one(
    played: PlayedRank, then: str
) -> None:
    """A prefill rank answers an ``Abort`` that came after the room's ``Status`` with that
    ``Status`` again, marked ``again`` (its first may have been lost). Here the first came:
    the repeat is dropped (counted as ``stale_room``), whether the room is no longer held, held
    anew by a later use of its number, or held anew by a use that aborted too; it never frees
    the later use's pages, which the rank may still write into until that use's own comes."""
    decode = _decode(played.address)
    try:
        first = decode.create_receiver(played.address, 7)
        first.init()
        first.send_metadata([0, 1], 0)
        assert played.received(3) == [("Register", None), ("Watch", 7), ("Destination", 7)]
        first.abort()
        assert played.received(1) == [("Abort", 7)]
        played.status(7, KVPoll.SUCCESS)  # the room's own, which the Abort crossed
        eventually(first.quiescent, "the first use's status")
        first.clear()
        later = None
        if then != "nothing":
            later = decode.create_receiver(played.address, 7)
            later.init()
            later.send_metadata([2, 3], 1)
            assert played.received(2) == [("Watch", 7), ("Destination", 7)]
            if then == "held_anew_and_aborted":
                later.abort()  # before the first use's repeat came
                assert played.received(1) == [("Abort", 7)]
        played.status(7, KVPoll.SUCCESS, again=True)  # the answer to the first use's Abort
        eventually(lambda: decode.dropped_messages.snapshot().get("stale_room", 0) == 1,
                   "the repeat dropped")
        assert decode.live_rooms() == (0 if later is None else 1)
        if later is not None:
            assert not later.quiescent()
            played.status(7, KVPoll.FAILED, REASON_PEER_ABORTED)  # the later use's own
            eventually(later.quiescent, "the later use's status")
            assert later.poll() == KVPoll.FAILED
        assert decode.dropped_messages.total == 1
    finally:
        decode.close()


def test_a_repeated_status_frees_the_pages_of_the_use_whose_first_was_lost(
    played: PlayedRank,
) -> None:
    """The room's ``Status`` was lost on the way; decode gives up (its ``Abort``) and clears
    the room, whose pages stay held: the rank's repeat of that ``Status`` frees them, also once
    the room number is held anew by a later use (the repeat comes first: a rank's statuses come
    in order), which it leaves waiting for its own."""
    decode = _decode(played.address)
    try:
        first = decode.create_receiver(played.address, 8)
        first.init()
        first.send_metadata([0, 1], 0)
        assert played.received(3) == [("Register", None), ("Watch", 8), ("Destination", 8)]
        first.abort()
        assert played.received(1) == [("Abort", 8)]
        first.clear()
        later = decode.create_receiver(played.address, 8)
        later.init()
        later.send_metadata([2, 3], 1)
        assert played.received(2) == [("Watch", 8), ("Destination", 8)]
        assert decode.live_rooms() == 2 and not first.quiescent()
        played.status(8, KVPoll.SUCCESS, again=True)
        eventually(first.quiescent, "the repeat")
        assert decode.live_rooms() == 1 and not later.quiescent()
        played.status(8, KVPoll.FAILED, "its own")
        eventually(later.quiescent, "the later use's status")
        assert decode.dropped_messages.total == 0
    finally:
        decode.close()


def test_a_use_whose_abort_went_out_before_its_destination_takes_no_repeat(
    played: PlayedRank,
) -> None:
    """An ``Abort`` sent (from another thread) while the destination was still to go out
    reaches the rank first, so the rank may answer it with an earlier use's ``Status`` again,
    then attach the destination and write into it: decode must not take that repeat for this
    use, which stays held until its own ``Status``."""
    decode = _decode(played.address)
    try:
        receiver = decode.create_receiver(played.address, 8)
        receiver.init()
        send = decode._peers.send

        def abort_first(ranks: Any, msg: wire.Message) -> None:
            if isinstance(msg, wire.Destination):
                receiver.abort()  # as the heartbeat thread could, between lock and send
            send(ranks, msg)

        decode._peers.send = abort_first  # type: ignore[method-assign]
        receiver.send_metadata([0, 1], 0)
        assert played.received(4) == [("Register", None), ("Watch", 8), ("Abort", 8),
                                      ("Destination", 8)]
        played.status(8, KVPoll.SUCCESS, again=True)
        eventually(lambda: decode.dropped_messages.total == 1, "the repeat dropped")
        assert not receiver.quiescent()
        played.status(8, KVPoll.FAILED, "its own")
        eventually(receiver.quiescent, "its own status")
    finally:
        decode.close()


# -- a prefill lost while its ranks may still write ------------------------------------------


def test_a_prefill_lost_but_alive_aborts_the_room_and_writes_nothing_into_given_back_pages(
) -> None:
    """The prefill's bootstrap stops answering its health checks (a blip, its connection cap)
    while its rank goes on: decode fails the paired room and tells the rank to abort it, which
    the rank does and answers with a ``Status``; only then is the room quiescent. When the
    prefill's scheduler reaches the request, its writes are refused: the decode pages, given
    back and reused, stay as the next owner left them. Before, decode sent no ``Abort``: the
    room was quiescent at once and the prefill later wrote into the pages, ending SUCCESS."""
    server = BootstrapServer(port=0)
    prefill = MooncakeKVManager(make_pool(), MetadataBuffers(8))
    prefill.register_to_bootstrap(server.address)
    dpool = make_pool()
    decode = MooncakeDecodeManager(dpool, MetadataBuffers(8), server.address,
                                   config=_NO_HEARTBEAT)
    try:
        rx = decode.create_receiver(server.address, 5)
        rx.init()
        rx.send_metadata([0, 1], 0)
        tx = prefill.create_sender(server.address, 5)
        assert drive(prefill, tx, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT

        decode._lose_prefill(f"lost contact with prefill {server.address}: 2 health checks "
                             "in a row failed")  # the heartbeat's verdict
        assert rx.poll() == KVPoll.FAILED
        assert "lost contact with prefill" in rx.failure_exception().reason
        assert drive(prefill, tx, _TERMINAL)[-1] == KVPoll.FAILED
        assert tx.failure_exception().reason == REASON_PEER_ABORTED
        eventually(rx.quiescent, "the prefill rank's Status for the aborted room")

        dpool.buffer.zero_()  # the decode peer gave pages 0 and 1 to another request
        decode._wake.set()  # the next health check: the prefill answers again
        eventually(lambda: decode.lost is None, "decode registered again")
        prefill.pool.buffer.fill_(7.0)
        tx.init(2, 0)  # the prefill's scheduler reaches the request
        prefill.metadata.write(0, first_token=1, cached_tokens=0, logprob=None, room=5)
        tx.send([3, 4], last=True)
        assert tx.poll() == KVPoll.FAILED and tx.quiescent()
        assert rx.poll() == KVPoll.FAILED and rx.quiescent()
        assert float(dpool.page_view()[:, 0:2].abs().sum()) == 0.0
        assert decode.dropped_messages.total == prefill.dropped_messages.total == 0
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_a_room_of_a_lost_prefill_is_held_until_its_status_and_aborted_again_on_return(
    played: PlayedRank,
) -> None:
    """The ``Abort`` sent when the prefill was lost may be lost with the connection: the room
    stays held (its pages reserved) while the rank says nothing, the same instance answering
    again is sent the ``Abort`` once more (after the ``Register``), and the rank's ``Status``
    lets the room go; the room keeps the reason it failed with."""
    decode = _decode(played.address)
    pushed = Pushed(decode)
    try:
        rx = _held_room(played, decode)
        assert 5 in pushed.take()
        assert decode.live_rooms() == 1 and decode.lost is not None

        decode._wake.set()  # the next health check: the same instance answers
        eventually(lambda: decode.lost is None, "decode registered again")
        assert played.received(2) == [("Register", None), ("Abort", 5)]
        assert rx.poll() == KVPoll.FAILED and not rx.quiescent()

        played.status(5, KVPoll.FAILED, REASON_PEER_ABORTED)
        pushed.wait_for(5)
        assert rx.quiescent()
        assert rx.poll() == KVPoll.FAILED
        assert "lost contact with prefill" in rx.failure_exception().reason
        rx.clear()
        assert decode.live_rooms() == 0
        assert decode.dropped_messages.total == 0
    finally:
        decode.close()


def test_a_held_room_is_cleared_and_still_counted_until_its_status(played: PlayedRank) -> None:
    """A held room its owner clears anyway stays counted (the router does not retire a
    manager that a prefill rank may still write through) until the rank's ``Status``."""
    decode = _decode(played.address)
    try:
        rx = _held_room(played, decode)
        rx.clear()
        assert decode.live_rooms() == 1
        played.status(5, KVPoll.FAILED, REASON_PEER_ABORTED)
        eventually(lambda: decode.live_rooms() == 0, "the Status of the cleared room")
        assert decode.dropped_messages.total == 0
    finally:
        decode.close()


def test_a_held_room_is_released_when_another_instance_answers(played: PlayedRank) -> None:
    """A prefill restarted while it counted as gone: the process that held the room writes
    nothing more, so the room is quiescent as the new instance answers, and the new instance
    is sent no ``Abort`` for it (only the ``Register``)."""
    decode = _decode(played.address)
    pushed = Pushed(decode)
    restarted: PlayedRank | None = None
    try:
        rx = _held_room(played, decode)
        pushed.take()
        played.close()
        restarted = PlayedRank(make_pool(), port=played.port)
        decode._wake.set()
        eventually(lambda: decode.lost is None, "decode registered with the new instance")
        assert rx.quiescent() and rx.poll() == KVPoll.FAILED
        assert 5 in pushed.take()
        assert restarted.received(1) == [("Register", None)]
        assert restarted.nothing_queued()
    finally:
        decode.close()
        if restarted is not None:
            restarted.close()


def test_a_held_room_is_released_at_the_bound(played: PlayedRank,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A prefill that neither answers nor is known gone: the room is held for
    ``lost_release_timeout_s`` (30 s by default, as SGLang bounds a deferred release), then
    quiescent, pushed, and the release logged as the risk it is."""
    assert LOST_RELEASE_TIMEOUT_S == 30.0
    decode = _decode(played.address)
    pushed = Pushed(decode)
    try:
        before = time.monotonic()
        rx = _held_room(played, decode)
        after = time.monotonic()
        pushed.take()
        assert decode._release_overdue(now=before + LOST_RELEASE_TIMEOUT_S - 0.001) == []
        assert not rx.quiescent() and pushed.take() == []
        with caplog.at_level(logging.WARNING, logger="kv.mooncake_decode"):
            assert decode._release_overdue(now=after + LOST_RELEASE_TIMEOUT_S) == [5]
        assert rx.quiescent() and rx.poll() == KVPoll.FAILED
        assert pushed.take() == [5]
        assert "sent no Status for 1 rooms (5) within 30 s" in caplog.text
        assert decode._release_overdue(now=after + 2 * LOST_RELEASE_TIMEOUT_S) == []
    finally:
        decode.close()


def test_the_control_listener_releases_an_overdue_room_by_itself(played: PlayedRank) -> None:
    """Nobody calls the check: the listener's tick releases the room once its bound passed
    (a bound of 50 ms here), so every end becomes quiescent."""
    decode = _decode(played.address, attrs.evolve(_NO_HEARTBEAT, lost_release_timeout_s=0.05))
    try:
        rx = _held_room(played, decode)
        eventually(rx.quiescent, "the bound passing")
    finally:
        decode.close()


@pytest.mark.parametrize(("bound", "why"), [
    (0, "a finite number of seconds > 0, got 0"), (-1.0, "a finite number of seconds > 0"),
    (math.nan, "a finite number of seconds > 0"), (math.inf, "a finite number of seconds > 0"),
    (True, "a number, got True"), ("30", "a number, got '30'"),
])
def test_the_release_bound_must_be_positive_seconds(bound: Any, why: str) -> None:
    with pytest.raises((ValueError, TypeError),
                       match=rf"lost_release_timeout_s must be {re.escape(why)}"):
        MooncakeConfig(lost_release_timeout_s=bound)


def test_the_release_bound_of_pdlife_serve_reaches_the_decode_manager(
    played: PlayedRank,
) -> None:
    """``pdlife serve --lost-prefill-release-timeout 7.5``: the decode manager built from the
    served config holds a lost prefill's room 7.5 s, not the default 30 s."""
    from scheduler.cli.main import build_parser
    from scheduler.cli.serve import serve_config

    args = build_parser("serve").parse_args(
        ["serve", "--role", "decode", "--lost-prefill-release-timeout", "7.5"])
    served = serve_config(args).mooncake
    assert served.lost_release_timeout_s == 7.5
    # Only the heartbeat's own checks are left out: the test gives its verdicts.
    decode = _decode(played.address, attrs.evolve(served, heartbeat_interval_s=3600))
    try:
        before = time.monotonic()
        rx = _held_room(played, decode)
        after = time.monotonic()
        assert decode._release_overdue(now=before + 7.5 - 0.001) == []
        assert not rx.quiescent()
        assert decode._release_overdue(now=after + 7.5) == [5]
        assert rx.quiescent()
    finally:
        decode.close()


def test_a_prefill_restarted_between_two_checks_leaves_nothing_held(played: PlayedRank) -> None:
    """Another instance answering while the prefill did not count as gone: the old rooms are
    quiescent at once (their process is no more), none held, none aborted."""
    decode = _decode(played.address)
    restarted: PlayedRank | None = None
    try:
        rx = decode.create_receiver(played.address, 5)
        rx.init()
        rx.send_metadata([0, 1], 0)
        assert played.received(3)[-1] == ("Destination", 5)
        played.close()
        restarted = PlayedRank(make_pool(), port=played.port)
        decode._wake.set()
        assert restarted.received(1) == [("Register", None)]
        eventually(lambda: decode.lost is None, "decode registered with the new instance")
        assert rx.poll() == KVPoll.FAILED and rx.quiescent()
        assert "restarted (another instance" in rx.failure_exception().reason
        assert restarted.nothing_queued()
    finally:
        decode.close()
        if restarted is not None:
            restarted.close()


# -- a prefill that says it stopped writing --------------------------------------------------


def test_a_held_room_is_released_when_its_prefill_says_it_stopped_writing(
    played: PlayedRank, caplog: pytest.LogCaptureFixture,
) -> None:
    """The prefill's engine failed (its server marked its bootstrap endpoint unhealthy: no rank
    of it writes any more) while decode held a room for it: the next health check lets the room
    go, long before the bound, logging the prefill's reason; the prefill is not registered
    with again (no ``Register``, no ``Abort``)."""
    decode = _decode(played.address)
    pushed = Pushed(decode)
    try:
        rx = _held_room(played, decode)
        pushed.take()
        played.server.mark_unhealthy("the prefill server's engine failed: boom",
                                     writes_stopped=True)
        with caplog.at_level(logging.INFO, logger="kv.mooncake_decode"):
            decode._wake.set()  # the next health check
            pushed.wait_for(5)  # within TIMEOUT_S (10 s): the bound is 30 s

            def released() -> list[str]:
                return [r.getMessage() for r in caplog.records if "released" in r.getMessage()]

            # Logged just after the room was pushed.
            eventually(lambda: bool(released()), "the release logged")
        assert rx.quiescent() and rx.poll() == KVPoll.FAILED
        assert decode.live_rooms() == 1  # until its owner clears it
        assert decode._release_overdue(now=time.monotonic() + LOST_RELEASE_TIMEOUT_S) == []
        assert released() == [
            f"lost contact with prefill {played.address}: it stopped writing KV (its bootstrap "
            "endpoint answers unhealthy: \"the prefill server's engine failed: boom\"): the 1 "
            "rooms held for it are released"]
        assert decode.lost is not None
        assert played.nothing_queued()
        rx.clear()
        assert decode.live_rooms() == 0
    finally:
        decode.close()


def test_a_prefill_that_says_it_stopped_writing_fails_its_rooms_quiescent_at_once(
    played: PlayedRank,
) -> None:
    """A prefill that answered every check until its engine failed: the first check that finds
    it unhealthy fails its rooms with its reason, quiescent at once (nothing held, no
    ``Abort``), and a room created afterwards fails at once too."""
    decode = _decode(played.address)
    pushed = Pushed(decode)
    try:
        rx = decode.create_receiver(played.address, 5)
        rx.init()
        rx.send_metadata([0, 1], 0)
        assert played.received(3)[-1] == ("Destination", 5)
        assert not rx.quiescent()
        pushed.take()
        played.server.mark_unhealthy("the prefill server's engine failed: boom",
                                     writes_stopped=True)
        decode._wake.set()
        pushed.wait_for(5)
        assert rx.poll() == KVPoll.FAILED and rx.quiescent()
        assert rx.failure_exception().reason == (
            f"lost contact with prefill {played.address}: it stopped writing KV (its bootstrap "
            "endpoint answers unhealthy: \"the prefill server's engine failed: boom\")")
        later = decode.create_receiver(played.address, 6)
        assert later.poll() == KVPoll.FAILED and later.quiescent()
        assert "it stopped writing KV" in later.failure_exception().reason
        assert played.nothing_queued()
    finally:
        decode.close()


def test_a_held_room_of_a_prefill_that_stops_answering_waits_for_the_bound(
    played: PlayedRank,
) -> None:
    """A prefill whose bootstrap endpoint answers nothing (gone, or cut off while its ranks may
    still write) has not said it stopped: a check finds nothing and the room stays held, until
    the bound."""
    decode = _decode(played.address)
    try:
        rx = _held_room(played, decode)
        after = time.monotonic()
        played.server.close()
        assert decode._check_prefill(BootstrapClient(played.address, timeout_s=1)) is False
        assert not rx.quiescent()
        assert decode._release_overdue(now=after + LOST_RELEASE_TIMEOUT_S - 1) == []
        assert not rx.quiescent()
        assert decode._release_overdue(now=after + LOST_RELEASE_TIMEOUT_S) == [5]
        assert rx.quiescent()
    finally:
        decode.close()


# -- the metadata gate -----------------------------------------------------------------------


@pytest.mark.parametrize("row_room", [5, 6])
def test_a_room_whose_status_came_before_its_row_is_pushed_when_the_row_lands(
    played: PlayedRank, row_room: int,
) -> None:
    """A SUCCESS ``Status`` that overtakes its metadata row (a transport that reports a write
    before its bytes are visible): the room polls TRANSFERRING and is not pushed again at once
    (no busy loop), but is pushed when the row lands, and polls SUCCESS, or FAILED for a row
    carrying another room. Before, nothing pushed it: its owner waited out its timeout."""
    metadata = MetadataBuffers(8)
    decode = MooncakeDecodeManager(make_pool(), metadata, played.address, config=_NO_HEARTBEAT)
    pushed = Pushed(decode)
    try:
        rx = decode.create_receiver(played.address, 5)
        rx.init()
        rx.send_metadata([0, 1], 0)
        played.received(3)
        pushed.take()
        played.status(5, KVPoll.SUCCESS)
        pushed.wait_for(5)
        assert rx.poll() == KVPoll.TRANSFERRING
        assert pushed.take() == []

        metadata.write(0, first_token=11, cached_tokens=0, logprob=None, room=row_room)
        pushed.wait_for(5)
        if row_room == 5:
            assert rx.poll() == KVPoll.SUCCESS
        else:
            assert rx.poll() == KVPoll.FAILED
            assert "a stale or corrupted row" in rx.failure_exception().reason
        assert rx.quiescent()
    finally:
        decode.close()


# -- a construction that fails half-way ------------------------------------------------------


def test_a_decode_manager_whose_construction_fails_closes_what_it_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second prefill rank's control socket cannot be opened (the process is out of file
    descriptors) after the engine, the context, the status socket and the first rank's socket
    were: the constructor raises and closes all of them, so nothing is left for the garbage
    collector, whose termination of a context with an open socket blocked for ever."""
    pool = make_pool()
    server = BootstrapServer(port=0, expected_ranks=2)
    for rank in (0, 1):
        BootstrapClient(server.address).register(
            _rank_info(pool, f"tcp://127.0.0.1:{9 + rank}", rank=rank, dp_size=2))
    opened: list[zmq.Socket[Any]] = []
    real_push_socket = kv.mooncake_peers.push_socket

    def out_of_descriptors(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
        if opened:
            raise zmq.ZMQError(errno.EMFILE)
        opened.append(real_push_socket(ctx, endpoint))
        return opened[-1]

    endpoints: list[ControlEndpoint] = []

    class Recorded(ControlEndpoint):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            endpoints.append(self)

    monkeypatch.setattr(kv.mooncake_peers, "push_socket", out_of_descriptors)
    monkeypatch.setattr(kv.mooncake_decode, "ControlEndpoint", Recorded)
    try:
        with pytest.raises(zmq.ZMQError) as failed:
            MooncakeDecodeManager(pool, MetadataBuffers(8), server.address)
        assert failed.value.errno == errno.EMFILE
        (endpoint,) = endpoints
        assert [s.closed for s in opened] == [True]
        assert endpoint.ctx.closed
        with pytest.raises(MooncakeError, match="closed"):
            endpoint.engine.submit_write("127.0.0.1:9", [1], [1], [1])
        assert not [t for t in threading.enumerate()
                    if t.name in ("mooncake-status", "mooncake-heartbeat") and t.is_alive()]
        del failed, endpoint
        endpoints.clear()
        _assert_collected()
    finally:
        server.close()


def _assert_collected() -> None:
    """A garbage collection ends: one that terminates a context with an open socket blocks for
    ever (so it runs on a thread of its own)."""
    collected = threading.Event()
    threading.Thread(target=lambda: (gc.collect(), collected.set()), daemon=True).start()
    assert collected.wait(TIMEOUT_S), "the garbage collector hangs"


def _failure_of(construct: Callable[[], object]) -> BaseException:
    """What ``construct`` raised, left where a caller that keeps an exception leaves it: in a
    reference cycle with the frames it went through (this one's local holds it, and its
    traceback this frame), so only the garbage collector frees what those frames hold."""
    try:
        construct()
    except Exception as exc:
        failure = exc
        return failure
    raise AssertionError("the construction did not fail")


def _record_engines(monkeypatch: pytest.MonkeyPatch, *modules: Any) -> list[MooncakeEngine]:
    """Every :class:`MooncakeEngine` that ``modules`` create from now on, as they create it."""
    engines: list[MooncakeEngine] = []

    class Recorded(MooncakeEngine):
        def __init__(self, config: MooncakeConfig) -> None:
            super().__init__(config)
            engines.append(self)

    for module in modules:
        monkeypatch.setattr(module, "MooncakeEngine", Recorded)
    return engines


def _assert_closed(engine: MooncakeEngine) -> None:
    with pytest.raises(MooncakeError, match="closed"):
        engine.submit_write("127.0.0.1:9", [1], [1], [1])


def _new_threads(before: set[threading.Thread]) -> list[str]:
    return [t.name for t in threading.enumerate() if t not in before and t.is_alive()]


@pytest.mark.parametrize("fails", ["bind", "register"])
def test_a_control_endpoint_whose_construction_fails_closes_what_it_opened(
    monkeypatch: pytest.MonkeyPatch, fails: str,
) -> None:
    """The control socket cannot bind (no port free on the host) once the engine, the context
    and the socket exist, or the engine refuses to register the metadata buffers once it
    registered the pool: the constructor raises and closes what it opened, the socket and the
    context at linger 0, then the engine, so the garbage collector, whose termination of a
    context with an open socket blocked for ever, ends. No thread is left."""
    opened: list[zmq.Socket[Any]] = []
    if fails == "bind":
        def no_free_port(sock: zmq.Socket[Any], addr: str, *args: Any, **kwargs: Any) -> int:
            opened.append(sock)
            raise zmq.ZMQError(errno.EADDRINUSE)

        monkeypatch.setattr(zmq.Socket, "bind_to_random_port", no_free_port)
    else:
        class Refusing(mooncake.engine.TransferEngine):  # type: ignore[misc]
            registered = 0

            def register_memory(self, ptr: int, length: int) -> int:
                Refusing.registered += 1
                return -1 if Refusing.registered == 2 else int(super().register_memory(ptr,
                                                                                       length))

        monkeypatch.setattr(mooncake.engine, "TransferEngine", Refusing)
    engines = _record_engines(monkeypatch, kv.mooncake_engine)
    before = set(threading.enumerate())
    failure = _failure_of(lambda: ControlEndpoint(
        MooncakeConfig(), make_pool(), MetadataBuffers(8), lambda msg: None,
        name="mooncake-test", log=logging.getLogger(__name__)))
    if fails == "bind":
        assert isinstance(failure, zmq.ZMQError) and failure.errno == errno.EADDRINUSE
        (sock,) = opened
        assert sock.closed and sock.context.closed
    else:
        assert isinstance(failure, MooncakeError)
        assert re.fullmatch(r"register_memory\(0x[0-9a-f]+, \d+\) returned -1", str(failure))
    (engine,) = engines
    _assert_closed(engine)
    assert _new_threads(before) == []
    del failure, engine
    opened.clear()
    engines.clear()
    _assert_collected()


def test_a_prefill_manager_whose_construction_fails_closes_what_it_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control listener's thread cannot start (the process is out of threads) once the
    control endpoint, a second engine and the transfer workers exist: the constructor raises
    and stops the workers, closes the control socket and the context, then both engines, so
    the garbage collector ends and no thread is left."""
    real_start = threading.Thread.start

    def out_of_threads(thread: threading.Thread) -> None:
        if thread.name == "mooncake-listen":
            raise RuntimeError("can't start new thread")
        real_start(thread)

    endpoints: list[ControlEndpoint] = []

    class Recorded(ControlEndpoint):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            endpoints.append(self)

    engines = _record_engines(monkeypatch, kv.mooncake_engine, kv.mooncake)
    monkeypatch.setattr(kv.mooncake, "ControlEndpoint", Recorded)
    monkeypatch.setattr(threading.Thread, "start", out_of_threads)
    before = set(threading.enumerate())
    failure = _failure_of(lambda: MooncakeKVManager(make_pool(), MetadataBuffers(8),
                                                    config=MooncakeConfig(engines=2)))
    assert isinstance(failure, RuntimeError) and str(failure) == "can't start new thread"
    (endpoint,) = endpoints
    assert endpoint.ctx.closed  # its term() ended: every socket of it was closed
    assert len(engines) == 2
    for engine in engines:
        _assert_closed(engine)
    assert _new_threads(before) == []
    del failure, endpoint
    endpoints.clear()
    engines.clear()
    _assert_collected()


@pytest.mark.parametrize(("endpoint", "why"), [
    ("tcp://bad host:1", "host 'bad host'"),
    ("tcp://prefill-0", "no port"),
    ("tcp://prefill-0:0", "port '0'"),
    ("tcp://prefill-0:65536", "port '65536'"),
    ("tcp://prefill-0:1x", "port '1x'"),
    ("tcp://:5555", "host ''"),
    ("tcp://[::1:5555", "host '[::1'"),
    ("tcp://a..b:5555", "host 'a..b'"),
])
def test_a_rank_registration_names_a_control_endpoint_zeromq_can_connect_to(
    endpoint: str, why: str,
) -> None:
    """A registration read from JSON whose endpoint is not ``tcp://HOST:PORT`` is refused,
    naming the field: at the bootstrap endpoint (400) and in a table a decode peer reads,
    before it opens anything (the endpoint once reached ZeroMQ's connect, failing a decode
    manager that had opened its engine)."""
    body = attrs.asdict(_rank_info(make_pool(), endpoint))
    with pytest.raises(ValueError, match=r"^endpoint must be 'tcp://HOST:PORT' \(a host name "
                                         r"or IP address, a port in 1..65535\), got "):
        RankInfo.from_json(body)
    with pytest.raises(ValueError, match=f"{re.escape(why)}$"):
        RankInfo.from_json(body)
    server = BootstrapServer(port=0)
    try:
        with pytest.raises(BootstrapError) as refused:
            BootstrapClient(server.address).register(_rank_info(make_pool(), endpoint))
        assert refused.value.status == 400 and "endpoint must be" in str(refused.value)
        assert server.registered == 0
    finally:
        server.close()


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:5555", "tcp://prefill-0.pdlife.svc.cluster.local:5555",
    "tcp://[::1]:5555", "tcp://::1:5555", "tcp://node_1:65535",
])
def test_a_control_endpoint_of_a_host_name_or_address_is_taken(endpoint: str) -> None:
    body = attrs.asdict(_rank_info(make_pool(), endpoint))
    assert RankInfo.from_json(body).endpoint == endpoint


def test_a_decode_peer_refuses_a_table_with_a_bad_endpoint_before_it_opens_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A table served with a rank whose endpoint ZeroMQ cannot parse (here put in place
    behind the endpoint's own check) fails the look-up, naming the field; no engine opens."""
    pool = make_pool()
    server = BootstrapServer(port=0)
    server._register(_rank_info(pool, "tcp://bad host:1"))
    opened: list[object] = []
    monkeypatch.setattr(kv.mooncake_decode, "ControlEndpoint",
                        lambda *a, **k: opened.append(a))
    try:
        with pytest.raises(MooncakeError, match="endpoint must be 'tcp://HOST:PORT'"):
            MooncakeDecodeManager(pool, MetadataBuffers(8), server.address)
        assert opened == []
    finally:
        server.close()
