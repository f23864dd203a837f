"""The transfer contract (kv/transfer.py), run over every backend harness.

To cover another backend, write its harness (see tests/transfer_harness.py) and append it to
``HARNESSES`` below, and, when it moves data, to ``DATA_HARNESSES`` in every pool layout: the
byte-for-byte tests run those; when its sessions play the decode side, to ``PEER_HARNESSES``.
A backend outside this repository runs the suite with ``pytest tests/test_transfer_contract.py
--transfer-harness MODULE:NAME`` (docs/backends.md, "A backend of your own").
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from typing import cast

import pytest
import torch

from kv.pool_layout import KVLayout
from kv.transfer import (
    REASON_ABORTED,
    REASON_OTHER_RANK,
    KVPoll,
    KVSender,
    TransferError,
    TransferUsageError,
    refusal,
)
from tests.mooncake_harness import MooncakeHarness
from tests.transfer_harness import (
    NUM_SLOTS,
    BackendHarness,
    FakeHarness,
    HarnessSession,
    LocalHarness,
    PeerSession,
    drive,
    eventually,
    load_harnesses,
)

HARNESSES: list[BackendHarness] = [FakeHarness(), LocalHarness(), MooncakeHarness()]
#: Every harness that moves data, in every pool layout.
DATA_HARNESSES: list[BackendHarness] = [
    harness(layout) for harness in (LocalHarness, MooncakeHarness) for layout in KVLayout
]
#: Every harness with a decode peer, in the default pool layout.
PEER_HARNESSES: list[BackendHarness] = [LocalHarness(), MooncakeHarness()]

ROOM = (1 << 63) + 12345  # above the int64 range: rooms are unsigned 64-bit

_TERMINAL = (KVPoll.SUCCESS, KVPoll.FAILED)


def _harnesses(config: pytest.Config, fixture: str) -> list[BackendHarness]:
    """The harnesses ``fixture`` runs over: this repository's, and those ``--transfer-harness``
    names that fit it."""
    extra = [h for spec in config.getoption("transfer_harness") for h in load_harnesses(spec)]
    if fixture == "data_session":
        return [*DATA_HARNESSES, *(h for h in extra if h.moves_data)]
    if fixture == "peer_session":
        return [*PEER_HARNESSES, *(h for h in extra if h.plays_decode)]
    return [*HARNESSES, *extra]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for fixture in ("session", "peer_session", "data_session"):
        if fixture in metafunc.fixturenames:
            metafunc.parametrize(fixture, [
                pytest.param(h, id=h.name, marks=h.marks)
                for h in _harnesses(metafunc.config, fixture)], indirect=True)


def _opened(request: pytest.FixtureRequest) -> Iterator[HarnessSession]:
    """A session of the fixture's harness, closed after the test."""
    harness: BackendHarness = request.param
    s = harness.make()
    yield s
    s.close()


@pytest.fixture
def session(request: pytest.FixtureRequest) -> Iterator[HarnessSession]:
    yield from _opened(request)


@pytest.fixture
def peer_session(request: pytest.FixtureRequest) -> Iterator[PeerSession]:
    yield from cast(Iterator[PeerSession], _opened(request))


@pytest.fixture
def data_session(request: pytest.FixtureRequest) -> Iterator[HarnessSession]:
    yield from _opened(request)


def _handshake(session: HarnessSession, room: int, num_pages: int) -> tuple[KVSender, list[KVPoll]]:
    sender = session.manager.create_sender(session.bootstrap_addr, room)
    first = sender.poll()
    assert first == KVPoll.BOOTSTRAPPING
    session.connect_decode(room, num_pages)
    seen = drive(session.manager, sender, {KVPoll.WAITING_FOR_INPUT, KVPoll.FAILED})
    assert seen[-1] == KVPoll.WAITING_FOR_INPUT, seen
    return sender, [first, *seen]


def _assert_monotone(seen: list[KVPoll]) -> None:
    assert all(a < b for a, b in pairwise(seen)), [s.name for s in seen]


def test_poll_order_and_success_only_after_all_pages(session: HarnessSession) -> None:
    sender, seen = _handshake(session, ROOM, 6)
    sender.init(6, 3)
    assert sender.poll() == KVPoll.WAITING_FOR_INPUT
    sender.send([0, 1], last=False)
    sender.send([2, 3], last=False)
    assert sender.poll() == KVPoll.TRANSFERRING
    # Once every queued chunk ran, the room still waits for its last chunk.
    eventually(sender.quiescent, "the first two chunks to finish")
    assert sender.poll() == KVPoll.TRANSFERRING
    session.prefill_metadata.write(3, first_token=7, cached_tokens=0, logprob=None, room=ROOM)
    sender.send([4, 5], last=True)
    seen += drive(session.manager, sender, _TERMINAL)
    seen = [s for i, s in enumerate(seen) if i == 0 or seen[i - 1] != s]
    assert seen[-1] == KVPoll.SUCCESS
    _assert_monotone(seen)
    assert set(seen) >= {KVPoll.BOOTSTRAPPING, KVPoll.WAITING_FOR_INPUT, KVPoll.SUCCESS}
    assert sender.poll() == KVPoll.SUCCESS
    eventually(sender.quiescent, "quiescence after success")


@pytest.mark.parametrize("offered", [1, 3])
def test_a_destination_unlike_the_prompt_fails_the_room(
        peer_session: PeerSession, offered: int) -> None:
    """The decode's pages cover another prompt than the prefill's (the two workers were sent
    different prompts): too few cannot hold it, and too many would leave the decode reading
    pages the prefill never wrote."""
    room = 60 + offered
    sender, _ = _handshake(peer_session, room, offered)
    sender.init(2, 0)
    assert drive(peer_session.manager, sender, _TERMINAL)[-1] == KVPoll.FAILED
    reason = sender.failure_exception().reason
    assert any(said in reason for said in (  # the local backend's words, Mooncake's
        f"gave {offered} destination pages, 2 are needed",
        f"offered {offered} pages, the request needs 2")), reason
    eventually(sender.quiescent, "quiescence after the failure")
    sender.clear()


def test_zero_page_request_concludes_on_its_last_send(session: HarnessSession) -> None:
    sender, _ = _handshake(session, 7, 0)
    sender.init(0, 1)
    sender.send([], last=True)
    assert drive(session.manager, sender, _TERMINAL)[-1] == KVPoll.SUCCESS


@pytest.mark.parametrize("phase", ["bootstrapping", "waiting", "initialized", "transferring"])
def test_abort_in_each_state_fails_and_latches(session: HarnessSession, phase: str) -> None:
    room = 99
    if phase == "bootstrapping":
        sender = session.manager.create_sender(session.bootstrap_addr, room)
        assert sender.poll() == KVPoll.BOOTSTRAPPING
    else:
        sender, _ = _handshake(session, room, 4)
        if phase in ("initialized", "transferring"):
            sender.init(4, 0)
        if phase == "transferring":
            sender.send([8, 9], last=False)
            assert sender.poll() == KVPoll.TRANSFERRING
    sender.abort()
    assert drive(session.manager, sender, _TERMINAL)[-1] == KVPoll.FAILED
    # Latched, and late calls from a caller that had not yet seen the failure are ignored.
    if phase in ("bootstrapping", "waiting"):
        sender.init(4, 0)
    sender.send([10, 11], last=True)
    sender.abort()
    assert sender.poll() == KVPoll.FAILED
    error = sender.failure_exception()
    assert isinstance(error, TransferError)
    assert error.room == room
    assert "abort" in error.reason
    assert str(room) in str(error)
    eventually(sender.quiescent, "quiescence after abort")
    sender.clear()


@pytest.mark.parametrize("paired", [True, False], ids=["after-handshake", "before-handshake"])
def test_an_abort_with_a_reason_for_the_client_fails_the_peer_with_its_refusal(
    peer_session: HarnessSession, paired: bool
) -> None:
    """``abort(why)`` (a request failed for a reason its client is to see): the decode peer's
    end fails with the refusal of ``why``, whether its destination came before the abort or
    after; the sender's own end reports its abort."""
    room, why = 31, "rejected (400): the grammar engine cannot run this grammar"
    if paired:
        sender, _ = _handshake(peer_session, room, 4)
        sender.init(4, 0)
    else:
        sender = peer_session.manager.create_sender(peer_session.bootstrap_addr, room)
    sender.abort(why)
    assert drive(peer_session.manager, sender, _TERMINAL)[-1] == KVPoll.FAILED
    assert sender.failure_exception().reason == REASON_ABORTED
    if not paired:
        peer_session.connect_decode(room, 4)
    receiver = peer_session.receivers[room][-1]
    eventually(lambda: receiver.poll() == KVPoll.FAILED, "the peer's end to fail")
    error = receiver.failure_exception()
    assert error.refused and error.reason == refusal(why), error
    eventually(sender.quiescent, "quiescence after abort")
    sender.clear()


@pytest.mark.parametrize("refused", ["before", "after"])
def test_a_receiver_waiting_for_pages_fails_when_prefill_refuses_its_room(
    peer_session: PeerSession, refused: str
) -> None:
    """A receiver initialised without a destination (its request waits for decode pages)
    fails with the refusal as soon as the prefill side refuses the room, whether the refusal
    came before the receiver or after; quiescent, as nothing was written."""
    room, why = 41, "draining (503): the server is draining"
    if refused == "before":
        peer_session.manager.refuse(room, why)
    receiver = peer_session.wait_decode(room)
    if refused == "after":
        peer_session.manager.refuse(room, why)
    eventually(lambda: receiver.poll() == KVPoll.FAILED, "the waiting receiver to fail")
    error = receiver.failure_exception()
    assert error.refused and error.reason == refusal(why), error
    assert receiver.quiescent()
    receiver.clear()


@pytest.mark.parametrize("why", ["rejected (400): the grammar engine cannot run this grammar",
                                 ""], ids=["for-the-client", "plain"])
def test_a_receiver_waiting_for_pages_fails_when_its_sender_fails_first(
    peer_session: PeerSession, why: str
) -> None:
    """The sender fails before the room's destination came (``abort(why)``, or ``abort()``:
    its client went away): a receiver that waits for pages fails with it at once."""
    room = 42
    sender = peer_session.manager.create_sender(peer_session.bootstrap_addr, room)
    receiver = peer_session.wait_decode(room)
    sender.abort(why)
    eventually(lambda: receiver.poll() == KVPoll.FAILED, "the waiting receiver to fail")
    error = receiver.failure_exception()
    assert error.refused and error.reason == refusal(why or REASON_ABORTED), error
    assert drive(peer_session.manager, sender, _TERMINAL)[-1] == KVPoll.FAILED
    eventually(sender.quiescent, "quiescence after abort")
    sender.clear()
    receiver.clear()


def test_a_decode_refusal_fails_the_sender_that_waits_for_its_destination(
    peer_session: PeerSession,
) -> None:
    """The decode side refuses a room (``DecodeKVManager.refuse``: it refused the request, or
    gave up on it before its destination): the prefill's sender for it fails with the refusal
    at once, not at its bootstrap timeout."""
    room, why = 43, "draining (503): the decode server is draining"
    sender = peer_session.manager.create_sender(peer_session.bootstrap_addr, room)
    peer_session.decode.refuse(peer_session.bootstrap_addr, room, why)
    assert drive(peer_session.manager, sender, _TERMINAL)[-1] == KVPoll.FAILED
    error = sender.failure_exception()
    assert error.refused and error.reason == refusal(why), error
    eventually(sender.quiescent, "quiescence after the refusal")
    sender.clear()


def test_abort_after_success_changes_nothing(session: HarnessSession) -> None:
    sender, _ = _handshake(session, 5, 1)
    sender.init(1, 0)
    sender.send([3], last=True)
    assert drive(session.manager, sender, _TERMINAL)[-1] == KVPoll.SUCCESS
    sender.abort()
    assert sender.poll() == KVPoll.SUCCESS


def test_failure_exception_of_a_healthy_sender_blames_another_rank(
    session: HarnessSession,
) -> None:
    sender = session.manager.create_sender(session.bootstrap_addr, 11)
    error = sender.failure_exception()
    assert error.room == 11
    assert error.reason == REASON_OTHER_RANK
    assert sender.poll() != KVPoll.FAILED


@pytest.mark.parametrize("first_outcome", ["aborted", "succeeded"])
def test_clear_ignores_late_messages_and_the_room_is_reused(
    session: HarnessSession, first_outcome: str
) -> None:
    room = 4242
    first, _ = _handshake(session, room, 2)
    first.init(2, 0)
    if first_outcome == "aborted":
        first.abort()
    else:
        first.send([5, 6], last=True)
    drive(session.manager, first, _TERMINAL)
    eventually(first.quiescent, "the first request to be quiescent")
    first.clear()
    session.late_message(room)

    second, _ = _handshake(session, room, 3)
    second.init(3, 1)
    second.send([7, 8, 9], last=True)
    assert drive(session.manager, second, _TERMINAL)[-1] == KVPoll.SUCCESS


def test_readiness_is_pushed_for_the_handshake(session: HarnessSession) -> None:
    sender = session.manager.create_sender(session.bootstrap_addr, 31)
    sender.poll()
    session.connect_decode(31, 1)
    # drive() polls only after the room comes off the ready queue.
    assert drive(session.manager, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == (
        KVPoll.WAITING_FOR_INPUT
    )


def test_protocol_misuse_raises_usage_errors(session: HarnessSession) -> None:
    early = session.manager.create_sender(session.bootstrap_addr, 1)
    with pytest.raises(TransferUsageError):
        early.init(1, 0)
    sender, _ = _handshake(session, 2, 3)
    with pytest.raises(TransferUsageError, match="before init"):
        sender.send([0], last=False)
    sender.init(3, 0)
    with pytest.raises(TransferUsageError, match="declared"):
        sender.send([0, 1, 2, 3], last=False)
    with pytest.raises(TransferUsageError, match="unsent"):
        sender.send([0], last=True)


def test_many_rooms_interleaved_all_succeed(session: HarnessSession) -> None:
    rooms = list(range(100, 100 + NUM_SLOTS))
    senders = {}
    for i, room in enumerate(rooms):
        senders[room], _ = _handshake(session, room, 4)
        senders[room].init(4, i)
    for half in (0, 1):
        for i, room in enumerate(rooms):
            senders[room].send([4 * i + 2 * half, 4 * i + 2 * half + 1], last=half == 1)
    for room in rooms:
        assert drive(session.manager, senders[room], _TERMINAL)[-1] == KVPoll.SUCCESS


def test_multi_chunk_transfer_lands_byte_for_byte(data_session: HarnessSession) -> None:
    session = data_session
    pool = session.prefill_pool
    generator = torch.Generator().manual_seed(0)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=generator))
    src = [3, 4, 5, 9, 0, 1, 2, 20, 21, 30]
    sender, _ = _handshake(session, ROOM, len(src))
    sender.init(len(src), 2)
    sender.send(src[:4], last=False)
    sender.send(src[4:7], last=False)
    session.prefill_metadata.write(2, first_token=123, cached_tokens=1, logprob=-0.5, room=ROOM)
    sender.send(src[7:], last=True)
    assert drive(session.manager, sender, _TERMINAL)[-1] == KVPoll.SUCCESS
    landed = session.decode_kv(ROOM)
    expected = pool.by_layer()[:, :, src]
    assert torch.equal(landed.view(torch.int32), expected.view(torch.int32))
    row = session.decode_row(ROOM)
    assert row is not None
    assert (row.first_token, row.cached_tokens, row.logprob, row.room) == (123, 1, -0.5, ROOM)
