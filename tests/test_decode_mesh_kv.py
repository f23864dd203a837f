"""The decode TP group's agreement on its receivers (``scheduler.decode.mesh_kv``), in one
process: a prefill at TP 1 over the local backend writes the head slices of two decode
ranks, each behind its own MeshDecodeKV, and the two agree on threads through an in-process
group (the same all-gather and MIN as gloo's, over a barrier). Each scenario asserts what every
rank's peer would see after each agreement: the agreed poll, the rooms handed to the peer, the
agreed quiescence."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from kv.local_decode import LocalDecodeManager
from kv.transfer import REASON_OTHER_RANK, KVPoll, TransferUsageError, refusal
from scheduler.decode.mesh_kv import MeshDecodeKV, MeshReceiver
from scheduler.messages import take_all
from tests.sliced_harness import ADDR, SRC_PAGES, TERMINAL, Pair, dst_pages, make_pair
from tests.transfer_harness import drive, eventually

ROOM = 31
TIMEOUT_S = 30.0


class _Group:
    """Rows of two ranks on two threads: each call returns every rank's row."""

    def __init__(self, world: int) -> None:
        self._barrier = threading.Barrier(world, timeout=TIMEOUT_S)
        self._rows: list[list[int]] = [[] for _ in range(world)]

    def gather(self, rank: int, row: Sequence[int]) -> list[list[int]]:
        self._rows[rank] = [int(v) for v in row]
        self._barrier.wait()
        rows = [list(r) for r in self._rows]
        self._barrier.wait()
        return rows


class _Ranks:
    """One rank's :class:`scheduler.dist.ranks.RankSync` over a :class:`_Group`."""

    def __init__(self, group: _Group, rank: int) -> None:
        self.group = group
        self.rank = rank

    def agree_keys(self, keys: Sequence[int]) -> list[int]:
        return sorted({k for row in self.group.gather(self.rank, keys) for k in row})

    def min_reduce(self, values: Sequence[int]) -> list[int]:
        rows = self.group.gather(self.rank, values)
        return [min(column) for column in zip(*rows, strict=True)]


@pytest.fixture
def pair() -> Iterator[Pair]:
    made = make_pair(1, 2)
    yield made
    made.close()


def _mesh(pair: Pair) -> list[MeshDecodeKV]:
    group = _Group(len(pair.decode))
    return [MeshDecodeKV(m, m.metadata, _Ranks(group, d), first=d == 0)
            for d, m in enumerate(pair.decode)]


def _agree(kvs: list[MeshDecodeKV]) -> list[list[int]]:
    """One agreement on every rank at once; the rooms each rank's peer is handed."""
    with ThreadPoolExecutor(len(kvs)) as pool:
        for done in [pool.submit(kv.agree) for kv in kvs]:
            done.result(timeout=TIMEOUT_S)
    return [take_all(kv.ready) for kv in kvs]


def _send(pair: Pair) -> None:
    """The prefill's one rank writes the room into both decode ranks and succeeds."""
    manager = pair.prefill[0]
    sender = manager.create_sender(ADDR, ROOM)
    assert drive(manager, sender, {KVPoll.WAITING_FOR_INPUT}) == [KVPoll.WAITING_FOR_INPUT]
    sender.init(len(SRC_PAGES), 2)
    manager.metadata.write(2, first_token=42, cached_tokens=1, logprob=None, room=ROOM)
    sender.send(SRC_PAGES, last=True)
    assert drive(manager, sender, TERMINAL)[-1] == KVPoll.SUCCESS
    sender.clear()


def _started(pair: Pair, kvs: list[MeshDecodeKV]) -> list[MeshReceiver]:
    receivers = [kv.create_receiver(ADDR, ROOM) for kv in kvs]
    for receiver in receivers:
        receiver.init()
    assert _agree(kvs) == [[ROOM], [ROOM]]
    assert [r.poll() for r in receivers] == [KVPoll.WAITING_FOR_INPUT] * 2
    for d, receiver in enumerate(receivers):
        receiver.send_metadata(dst_pages(d), slot=d)
    return receivers


def test_a_room_succeeds_on_every_rank_only_once_every_row_landed(pair: Pair) -> None:
    kvs = _mesh(pair)
    receivers = _started(pair, kvs)
    pair.decode[1].metadata.clear(1)  # rank 1's row is gone before anyone polls
    _send(pair)
    for receiver in receivers:
        eventually(lambda r=receiver: r.inner.poll().terminal, "the local transfer")  # type: ignore[misc, union-attr]
    pair.decode[1].metadata.clear(1)
    assert _agree(kvs) == [[ROOM], [ROOM]]
    assert [r.poll() for r in receivers] == [KVPoll.TRANSFERRING] * 2  # rank 1 has no row
    # The row lands; nothing pushes the room, but the gate asked for another look.
    pair.decode[1].metadata.write(1, first_token=42, cached_tokens=1, logprob=None, room=ROOM)
    assert _agree(kvs) == [[ROOM], [ROOM]]
    assert [r.poll() for r in receivers] == [KVPoll.SUCCESS] * 2
    assert [r.quiescent() for r in receivers] == [True, True]
    for receiver in receivers:
        receiver.clear()
    assert [kv.live_rooms() for kv in kvs] == [0, 0]
    assert pair.leaks() == []


def test_a_failure_on_one_rank_fails_the_room_on_both_and_they_free_together(
    pair: Pair,
) -> None:
    kvs = _mesh(pair)
    receivers = _started(pair, kvs)
    assert receivers[1].inner is not None
    receivers[1].inner.abort()  # only rank 1's own end fails
    assert _agree(kvs) == [[ROOM], [ROOM]]
    assert [r.poll() for r in receivers] == [KVPoll.FAILED] * 2
    # Ended (agreed FAILED) and no copy in flight on either rank: free on this pass, both.
    assert [r.quiescent() for r in receivers] == [True, True]
    for receiver in receivers:  # what the peer does with a FAILED poll, on both ranks
        receiver.abort()
    for receiver in receivers:
        receiver.clear()
    assert pair.leaks() == []


class _Unreachable(LocalDecodeManager):
    """A decode rank whose KV manager cannot create a receiver (a prefill it cannot reach)."""

    def create_receiver(self, bootstrap_addr: str, room: int):  # type: ignore[no-untyped-def]
        raise TransferUsageError(room, "prefill unreachable from this rank")


def test_a_receiver_that_fails_to_start_on_one_rank_fails_on_both(pair: Pair) -> None:
    broken = pair.decode[1]
    pair.decode[1] = _Unreachable(broken.pool, broken.metadata, hub=pair.hub, place=broken.place)
    kvs = _mesh(pair)
    receivers = [kv.create_receiver(ADDR, ROOM) for kv in kvs]
    for receiver in receivers:
        receiver.init()
    assert _agree(kvs) == [[ROOM], [ROOM]]
    assert [r.poll() for r in receivers] == [KVPoll.FAILED] * 2
    assert "prefill unreachable" in receivers[1].failure_exception().reason
    assert receivers[0].failure_exception().reason == REASON_OTHER_RANK


def test_a_refusal_seen_on_one_rank_is_the_reason_on_both(pair: Pair) -> None:
    kvs = _mesh(pair)
    receivers = [kv.create_receiver(ADDR, ROOM) for kv in kvs]
    receivers[0].init()  # rank 1's receiver has not started yet: it hears of nothing
    _agree(kvs)
    receivers[0].send_metadata(dst_pages(0), slot=0)
    pair.prefill[0].refuse(ROOM, "draining")
    eventually(lambda: receivers[0].inner.poll() == KVPoll.FAILED, "the refusal")  # type: ignore[union-attr]
    assert receivers[1].inner is not None and receivers[1].inner.poll() != KVPoll.FAILED
    assert _agree(kvs) == [[ROOM], [ROOM]]
    assert [r.poll() for r in receivers] == [KVPoll.FAILED] * 2
    assert receivers[0].failure_exception().reason == refusal("draining")
    assert receivers[1].failure_exception().reason == refusal(REASON_OTHER_RANK)
    assert [r.failure_exception().refused for r in receivers] == [True, True]
