"""The local backend between ranks of different parallel layouts: registrations that disagree
are refused naming both values, and a failure on one rank (an abort on either side, a refused
destination, a copy error) fails the room on every rank and leaves no record of it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kv.local import LocalKVManager, LocalTransferHub
from kv.local_decode import LocalDecodeManager
from kv.metadata import MetadataBuffers
from kv.pool import KVGeometryError, KVPool
from kv.pool_layout import KVLayout
from kv.rank_table import RankPlace
from kv.transfer import REASON_ABORTED, REASON_OTHER_RANK, REASON_PEER_ABORTED, KVPoll
from tests.sliced_harness import (
    ADDR,
    HEAD_DIM,
    NUM_PAGES,
    PAGE_SIZE,
    SRC_PAGES,
    TERMINAL,
    Pair,
    clear_all,
    closing_pairs,
    make_pair,
    make_pool,
    make_receivers,
    paired,
    rank_place,
    run_room,
    transfer,
)
from tests.transfer_harness import drive


@pytest.fixture
def closing() -> Iterator[list[Pair]]:
    yield from closing_pairs()


def _manager(hub: LocalTransferHub, place: RankPlace, **over: Any) -> LocalKVManager:
    return LocalKVManager(make_pool(place, KVLayout.LAYER_MAJOR, 0, **over), MetadataBuffers(2),
                          hub=hub, bootstrap_addr=ADDR, place=place)


@pytest.mark.parametrize(
    ("second", "over", "message"),
    [
        (rank_place(1, 2, heads=8, layers=3), {"head_dim": 8},
         "rank 1 has head_dim=8 but rank 0 has head_dim=4"),
        (rank_place(1, 2, heads=8, layers=3), {"page_size": 4},
         "rank 1 has page_size=4 but rank 0 has page_size=2"),
        (rank_place(1, 2, heads=4, layers=3), {},
         "rank 1 has kv_heads=4 but rank 0 has kv_heads=8"),
        (rank_place(1, 2, heads=8, layers=3), {"model": "other"},
         "rank 1 serves model other but rank 0 serves m"),
        (rank_place(0, 2, heads=8, layers=3), {}, "already registered .* as rank 0"),
        (rank_place(1, 2, heads=8, layers=3), {"kv_heads": 2},
         "its pool holds 2 heads of 3 layers, its place 4 heads of 3 layers"),
    ],
    ids=["head_dim", "page_size", "kv_heads", "model", "twice", "pool-vs-place"],
)
def test_a_rank_that_disagrees_is_refused_naming_both(
        second: RankPlace, over: dict[str, Any], message: str) -> None:
    hub = LocalTransferHub()
    first = _manager(hub, rank_place(0, 2, heads=8, layers=3))
    try:
        with pytest.raises(ValueError, match=message):
            _manager(hub, second, **over)
    finally:
        first.close()


@pytest.mark.parametrize(
    ("decode", "over", "message"),
    [
        (rank_place(0, 1, heads=8, layers=3), {"head_dim": 8}, r"head_dim: 4 vs 8 \(prefill vs"),
        (rank_place(0, 1, heads=8, layers=3), {"page_size": 4}, r"page_size: 2 vs 4 \(prefill vs"),
        (rank_place(0, 1, heads=4, layers=3), {}, "kv_heads: prefill 8 vs decode 4"),
        (rank_place(0, 1, heads=8, layers=4), {}, "num_layers: prefill 3 vs decode 4"),
        (rank_place(0, 3, heads=6, layers=3), {}, "kv_heads: prefill 8 vs decode 6"),
    ],
    ids=["head_dim", "page_size", "kv_heads", "layers", "tp3"],
)
def test_a_decode_rank_that_does_not_match_is_refused_naming_both(
        decode: RankPlace, over: dict[str, Any], message: str) -> None:
    hub = LocalTransferHub()
    managers = [_manager(hub, rank_place(t, 2, heads=8, layers=3)) for t in range(2)]
    try:
        receiver = LocalDecodeManager(make_pool(decode, KVLayout.LAYER_MAJOR, 1, **over),
                                      MetadataBuffers(2), hub=hub,
                                      place=decode).create_receiver(ADDR, 1)
        with pytest.raises(KVGeometryError, match=message):
            receiver.init()
    finally:
        for m in managers:
            m.close()


def test_a_receiver_waits_for_a_servers_missing_ranks() -> None:
    hub = LocalTransferHub()
    managers = [_manager(hub, rank_place(0, 2, heads=8, layers=3))]
    try:
        one = rank_place(0, 1, heads=8, layers=3)
        decode = LocalDecodeManager(make_pool(one, KVLayout.LAYER_MAJOR, 1), MetadataBuffers(2),
                                    hub=hub, place=one)
        waiting, cleared = decode.create_receiver(ADDR, 5), decode.create_receiver(ADDR, 6)
        other = LocalDecodeManager(make_pool(one, KVLayout.LAYER_MAJOR, 1, page_size=4),
                                   MetadataBuffers(2), hub=hub, place=one)
        mismatched = other.create_receiver(ADDR, 7)
        for receiver in (waiting, cleared, mismatched):
            receiver.init()
            assert receiver.poll() == KVPoll.BOOTSTRAPPING
        assert decode.ready.empty() and other.ready.empty()  # nothing happened yet
        cleared.clear()
        assert decode.ready.get_nowait() == 6  # the clear failed it
        managers.append(_manager(hub, rank_place(1, 2, heads=8, layers=3)))
        # The last rank registered: the waiting receiver is routed, the cleared one forgotten,
        # and a pool that does not match fails its room naming both values.
        assert waiting.poll() == KVPoll.WAITING_FOR_INPUT
        assert [decode.ready.get_nowait() for _ in range(decode.ready.qsize())] == [5]
        assert cleared.poll() == KVPoll.FAILED  # its own clear, nothing later
        assert mismatched.poll() == KVPoll.FAILED
        assert "page_size: 2 vs 4 (prefill vs decode)" in mismatched.failure_exception().reason
        assert hub.lookup(ADDR) is not None and not hub.lookup(ADDR).waiting  # type: ignore[union-attr]
        waiting.send_metadata([0], 0)
        assert waiting.poll() == KVPoll.TRANSFERRING
        waiting.clear()
        mismatched.clear()
        assert hub.open_rooms(ADDR) == 0
    finally:
        for m in managers:
            m.close()


# -- failures on one rank fail the room everywhere ----------------------------------------------



@pytest.mark.parametrize(("tp", "td", "pp"), [(2, 1, 1), (1, 2, 1), (4, 2, 1), (2, 1, 2)])
def test_an_abort_on_one_prefill_rank_fails_every_rank_and_leaks_nothing(
        closing: list[Pair], tp: int, td: int, pp: int) -> None:
    pair = make_pair(tp, td, pp=pp, layers=4)
    closing.append(pair)
    senders, receivers = paired(pair, 9)
    senders[0].init(len(SRC_PAGES), 0)
    senders[0].send(SRC_PAGES[:2], last=False)
    senders[-1].abort()
    assert senders[-1].failure_exception().reason == REASON_ABORTED
    for s in senders[:-1]:
        assert s.poll() == KVPoll.FAILED
        assert s.failure_exception().reason == REASON_OTHER_RANK
    for r in receivers:
        assert r.poll() == KVPoll.FAILED
        assert r.failure_exception().reason == REASON_PEER_ABORTED
    clear_all(pair, [*senders, *receivers])
    run_room(pair, 9)  # the room is free again


def test_an_abort_on_one_decode_rank_fails_every_rank(closing: list[Pair]) -> None:
    pair = make_pair(1, 2)
    closing.append(pair)
    senders, receivers = paired(pair, 3)
    receivers[1].abort()
    assert senders[0].failure_exception().reason == REASON_PEER_ABORTED
    assert receivers[0].failure_exception().reason == REASON_OTHER_RANK
    clear_all(pair, [*senders, *receivers])


def test_a_refused_destination_on_one_prefill_rank_fails_every_rank(closing: list[Pair]) -> None:
    pair = make_pair(2, 1)
    closing.append(pair)
    live = pair.prefill[0].create_sender(ADDR, 4)
    pair.prefill[1].refuse(4, "prompt_too_long")  # rank 1 never creates its sender
    (receiver,) = make_receivers(pair, 4)
    for end in (live, receiver):
        assert end.poll() == KVPoll.FAILED
        assert end.failure_exception().reason == "peer refused: prompt_too_long"
    clear_all(pair, [live, receiver])


class _BrokenPool(KVPool):
    """A decode pool whose copies raise: a lost device."""

    def by_layer(self) -> torch.Tensor:
        raise RuntimeError("device lost")


def test_a_copy_error_on_one_decode_rank_fails_every_rank(closing: list[Pair]) -> None:
    pair = make_pair(1, 2)
    closing.append(pair)
    broken = pair.decode[1]
    place = broken.place
    broken.pool = _BrokenPool(num_layers=3, num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                              kv_heads=place.heads_per_rank, head_dim=HEAD_DIM,
                              dtype=torch.bfloat16, model="m")
    senders, receivers = paired(pair, 6)
    senders[0].init(len(SRC_PAGES), 0)
    senders[0].send(SRC_PAGES, last=True)
    assert drive(pair.prefill[0], senders[0], TERMINAL)[-1] == KVPoll.FAILED
    for end in (*senders, *receivers):
        assert "device lost" in end.failure_exception().reason
    clear_all(pair, [*senders, *receivers])


def test_a_late_abort_from_an_old_receiver_spares_the_next_use_of_the_room(
        closing: list[Pair]) -> None:
    pair = make_pair(2, 2)
    closing.append(pair)
    senders, receivers = transfer(pair, 8)
    for s in senders:
        s.clear()
    run_room(pair, 8)  # old receivers still live: the room's next use pairs with new ones
    for r in receivers:
        r.abort()
        r.clear()
    assert pair.leaks() == []


def test_a_prefill_rank_closed_after_the_lookup_fails_the_room(closing: list[Pair]) -> None:
    pair = make_pair(2, 1)
    closing.append(pair)
    live = pair.prefill[0].create_sender(ADDR, 14)
    receiver = pair.decode[0].create_receiver(ADDR, 14)
    receiver.init()
    pair.prefill[1].close()
    receiver.send_metadata([0], 0)
    for end in (live, receiver):
        assert end.failure_exception().reason == "peer refused: prefill rank 1 closed"
    clear_all(pair, [live, receiver])


def test_a_decode_abort_before_any_sender_fails_the_senders_to_come(closing: list[Pair]) -> None:
    pair = make_pair(2, 1)
    closing.append(pair)
    (receiver,) = make_receivers(pair, 15)
    receiver.abort()
    receiver.clear()
    assert pair.leaks() == []  # the room is remembered as refused, not as a group
    senders = [m.create_sender(ADDR, 15) for m in pair.prefill]
    for s in senders:
        assert s.poll() == KVPoll.FAILED
        assert s.failure_exception().reason == f"peer refused: {REASON_PEER_ABORTED}"
    clear_all(pair, senders)
