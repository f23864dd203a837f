"""The fake transfer backend: protocol, delays, seeded faults, and the fake receiver."""

from __future__ import annotations

import queue

import pytest

from kv.fake import FakeDecodeManager, FakeKVManager, FaultPlan, RoomFaults
from kv.transfer import KVPoll, TransferUsageError
from lifecycle.testing import FakeClock


def _drain(q: queue.SimpleQueue[int]) -> list[int]:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


def test_a_chunked_request_stays_transferring_until_its_last_chunk() -> None:
    # Regression: a fake sender that concludes on the first send leaks the later chunks' pages.
    manager = FakeKVManager()
    sender = manager.create_sender("2.2.2.2:8998", 1)
    assert sender.poll() == KVPoll.WAITING_FOR_INPUT  # the handshake completes on the first poll
    sender.init(6, 0)
    sender.send([0, 1], last=False)
    assert sender.poll() == KVPoll.TRANSFERRING
    sender.send([2, 3], last=False)
    assert sender.poll() == KVPoll.TRANSFERRING
    assert sender.sent_pages == 4
    sender.send([4, 5], last=True)
    assert sender.poll() == KVPoll.SUCCESS
    assert sender.poll() == KVPoll.SUCCESS


def test_readiness_is_pushed_when_a_poll_would_change() -> None:
    manager = FakeKVManager()
    sender = manager.create_sender("x", 9)
    assert _drain(manager.ready) == [9]
    sender.poll()
    sender.init(1, 0)
    sender.send([0], last=True)
    assert _drain(manager.ready) == [9]


def test_delays_in_polls_and_seconds() -> None:
    clock = FakeClock()
    plan = FaultPlan(handshake_delay_polls=2, transfer_delay_s=1.5)
    manager = FakeKVManager(plan, clock)
    sender = manager.create_sender("x", 3)
    assert [sender.poll() for _ in range(3)] == [
        KVPoll.BOOTSTRAPPING,
        KVPoll.BOOTSTRAPPING,
        KVPoll.WAITING_FOR_INPUT,
    ]
    # Each held-back poll re-announced the room, so a ready-driven consumer polls again.
    assert _drain(manager.ready) == [3, 3, 3]
    sender.init(0, 0)
    sender.send([], last=True)
    assert sender.poll() == KVPoll.TRANSFERRING
    clock.now += 1.5
    assert sender.poll() == KVPoll.SUCCESS


def test_fault_decisions_are_deterministic_per_seed_and_room() -> None:
    plan = FaultPlan(seed=7, bootstrap_failure=0.3, bootstrap_timeout=0.3, transfer_failure=0.3)
    rooms = range(400)
    first = [plan.decide(r) for r in rooms]
    assert first == [plan.decide(r) for r in rooms]
    other = [FaultPlan(seed=8, bootstrap_failure=0.3).decide(r) for r in rooms]
    assert [f.bootstrap_failure for f in first] != [f.bootstrap_failure for f in other]
    assert 80 < sum(f.bootstrap_failure for f in first) < 160
    assert not any(f.bootstrap_failure and f.bootstrap_timeout for f in first)
    assert FaultPlan().decide(12345) == RoomFaults()


def test_bootstrap_failure_and_timeout() -> None:
    failing = FakeKVManager(FaultPlan(bootstrap_failure=1.0)).create_sender("x", 1)
    assert failing.poll() == KVPoll.FAILED
    assert failing.failure_exception().reason == "injected bootstrap failure"

    manager = FakeKVManager(FaultPlan(bootstrap_timeout=1.0))
    stuck = manager.create_sender("x", 2)
    assert {stuck.poll() for _ in range(50)} == {KVPoll.BOOTSTRAPPING}
    assert manager.ready.empty()  # nothing will change, so nothing is announced
    stuck.abort()
    assert stuck.poll() == KVPoll.FAILED
    assert stuck.failure_exception().reason == "aborted"


def test_transfer_failure_fails_the_first_send_and_ignores_the_rest() -> None:
    sender = FakeKVManager(FaultPlan(transfer_failure=1.0)).create_sender("x", 4)
    assert sender.poll() == KVPoll.WAITING_FOR_INPUT
    sender.init(4, 0)
    sender.send([0, 1], last=False)
    assert sender.poll() == KVPoll.FAILED
    sender.send([2, 3], last=True)
    assert sender.poll() == KVPoll.FAILED
    error = sender.failure_exception()
    assert (error.room, error.reason) == (4, "injected transfer failure")
    assert sender.quiescent()


def test_fault_plan_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"'transfer_failure' must be <= 1.0: 1.5"):
        FaultPlan(transfer_failure=1.5)
    with pytest.raises(ValueError, match=r"'bootstrap_timeout' must be >= 0.0: -0.5"):
        FaultPlan(bootstrap_timeout=-0.5)
    with pytest.raises(ValueError, match=r"'handshake_delay_polls' must be >= 0: -1"):
        FaultPlan(handshake_delay_polls=-1)


def test_fake_receiver_walks_its_states_and_latches() -> None:
    manager = FakeDecodeManager()
    receiver = manager.create_receiver("2.2.2.2:8998", 0)
    assert receiver.poll() == KVPoll.BOOTSTRAPPING
    with pytest.raises(TransferUsageError):
        receiver.send_metadata([1], 0)
    receiver.init()
    assert receiver.poll() == KVPoll.WAITING_FOR_INPUT
    receiver.send_metadata([1, 2], 0)
    assert receiver.poll() == KVPoll.SUCCESS
    receiver.abort()
    assert receiver.poll() == KVPoll.SUCCESS
    assert _drain(manager.ready) == [0, 0]

    aborted = manager.create_receiver("2.2.2.2:8998", 5)
    aborted.init()
    aborted.abort()
    assert aborted.poll() == KVPoll.FAILED
    aborted.send_metadata([1], 0)  # ignored: the caller had not yet seen the abort
    assert aborted.failure_exception().reason == "aborted"
