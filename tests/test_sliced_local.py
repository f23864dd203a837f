"""The local backend between ranks of different parallel layouts, in one process (one manager
per rank): random whole-model KV lands byte-exact on every decode rank for prefill TP {1, 2, 4}
x decode TP {1, 2, 4}, GQA replicas, MLA, prefill PP 2 -> decode PP 1 and DP replicas, and no
record of a room is left once every end is cleared; the fake backend's counts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv.fake import FakeDecodeManager, FakeKVManager, FaultPlan
from kv.pool_layout import KVLayout
from kv.transfer import KVPoll
from tests.sliced_harness import (
    ADDR,
    SRC_PAGES,
    TERMINAL,
    Pair,
    closing_pairs,
    dst_pages,
    make_pair,
    make_receivers,
    rank_place,
    run_room,
)
from tests.transfer_harness import drive, eventually


@pytest.fixture
def closing() -> Iterator[list[Pair]]:
    yield from closing_pairs()


@pytest.mark.parametrize("td", [1, 2, 4])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_heads_land_byte_exact(closing: list[Pair], tp: int, td: int) -> None:
    pair = make_pair(tp, td)
    closing.append(pair)
    run_room(pair)


@pytest.mark.parametrize(("tp", "td"), [(4, 2), (1, 2)])
def test_split_heads_land_byte_exact_page_major(closing: list[Pair], tp: int, td: int) -> None:
    pair = make_pair(tp, td, layout=KVLayout.PAGE_MAJOR)
    closing.append(pair)
    run_room(pair)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize(("tp", "td"), [(4, 1), (4, 2), (1, 4), (2, 4)])
def test_gqa_replicas_land_byte_exact(closing: list[Pair], tp: int, td: int, heads: int) -> None:
    pair = make_pair(tp, td, heads=heads)
    closing.append(pair)
    run_room(pair)
    # A replica no decode rank takes its head from writes nothing and reports status only.
    if tp > td and tp > heads:
        assert min(m.stats().chunks for m in pair.prefill) == 0


@pytest.mark.parametrize(("tp", "td"), [(4, 1), (2, 2), (1, 4)])
def test_mla_latent_lands_from_one_rank_each(closing: list[Pair], tp: int, td: int) -> None:
    pair = make_pair(tp, td, heads=1, mla=True)
    closing.append(pair)
    run_room(pair)
    writers = [m.rank for m in pair.prefill if m.stats().chunks]
    assert writers == [p for p in range(tp) if p % max(1, tp // td) == 0]


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize(("tp", "td"), [(1, 1), (2, 1), (2, 2), (1, 2)])
def test_two_prefill_stages_land_their_layers_on_one_decode_stage(
        closing: list[Pair], tp: int, td: int, layout: KVLayout) -> None:
    pair = make_pair(tp, td, layers=5, pp=2, layout=layout)  # stages of 2 and 3 layers
    closing.append(pair)
    run_room(pair)
    assert all(m.stats().chunks for m in pair.prefill)


@pytest.mark.parametrize(("tp", "td", "pp"), [(2, 1, 2), (1, 4, 1), (4, 2, 1)])
def test_destinations_before_the_senders_pair_as_well(
        closing: list[Pair], tp: int, td: int, pp: int) -> None:
    pair = make_pair(tp, td, pp=pp, layers=4)
    closing.append(pair)
    run_room(pair, decode_first=True)


def test_a_prefill_rank_waits_for_every_decode_rank_it_owes(closing: list[Pair]) -> None:
    pair = make_pair(1, 2)  # prefill rank 0 writes into decode ranks 0 and 1
    closing.append(pair)
    (prefill,) = pair.prefill
    sender = prefill.create_sender(ADDR, 12)
    first = pair.decode[0].create_receiver(ADDR, 12)
    first.init()
    first.send_metadata(dst_pages(0), 0)
    assert sender.poll() == KVPoll.BOOTSTRAPPING
    second = pair.decode[1].create_receiver(ADDR, 12)
    second.init()
    second.send_metadata(dst_pages(1), 1)
    assert drive(prefill, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    sender.init(len(SRC_PAGES), 0)
    sender.send(SRC_PAGES, last=True)
    assert drive(prefill, sender, TERMINAL)[-1] == KVPoll.SUCCESS
    for receiver in (first, second):
        eventually(lambda r=receiver: r.poll() == KVPoll.SUCCESS,  # type: ignore[misc]
                   "both decode ranks to complete")
    for end in (sender, first, second):
        end.clear()
    assert pair.leaks() == []


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_a_decode_room_completes_only_after_every_source_of_every_stage(
        closing: list[Pair], tp: int, pp: int) -> None:
    pair = make_pair(tp, 1, pp=pp, layers=4)
    closing.append(pair)
    senders = [m.create_sender(ADDR, 13) for m in pair.prefill]
    (receiver,) = make_receivers(pair, 13)
    for m, s in zip(pair.prefill, senders, strict=True):
        assert s.poll() == KVPoll.WAITING_FOR_INPUT
        s.init(len(SRC_PAGES), 0)
        m.metadata.write(0, first_token=42, cached_tokens=1, logprob=None, room=13)
    for i, (m, s) in enumerate(zip(pair.prefill, senders, strict=True)):
        s.send(SRC_PAGES, last=True)
        assert drive(m, s, TERMINAL)[-1] == KVPoll.SUCCESS
        if i < len(senders) - 1:
            assert receiver.poll() == KVPoll.TRANSFERRING, f"complete after {i + 1} sources"
    eventually(lambda: receiver.poll() == KVPoll.SUCCESS, "the last source to complete the room")
    for end in (*senders, receiver):
        end.clear()
    assert pair.leaks() == []


def test_dp_replicas_each_serve_their_rooms(closing: list[Pair]) -> None:
    pair = make_pair(2, 1, dp=2)
    closing.append(pair)
    for room in (10, 11):
        run_room(pair, room)
    assert [m.stats().chunks for m in pair.prefill] == [2, 2, 2, 2]


# -- refusals ---------------------------------------------------------------------------------


# -- the fake backend models the counts ---------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "td", "pp", "sources"),
    [(1, 1, 1, 1), (4, 2, 1, 2), (2, 4, 1, 1), (4, 1, 2, 8), (1, 2, 2, 2)],
)
def test_a_fake_decode_room_completes_after_its_sources_report(
        tp: int, td: int, pp: int, sources: int) -> None:
    manager = FakeDecodeManager(prefill=rank_place(0, tp, heads=8, layers=4, pp_size=pp),
                                place=rank_place(td - 1, td, heads=8, layers=4))
    assert manager.sources == sources
    receiver = manager.create_receiver("2.2.2.2:1", 5)
    receiver.init()
    receiver.send_metadata([0], 0)
    # The first source reports with the destination, each later one on a poll.
    polls = [receiver.poll() for _ in range(max(1, sources - 1))]
    assert polls == [KVPoll.TRANSFERRING] * (len(polls) - 1) + [KVPoll.SUCCESS]
    assert receiver.reported == sources


def test_a_fake_sender_waits_for_every_destination_and_status_only_ranks_write_nothing() -> None:
    wide = FakeKVManager(place=rank_place(1, 2, heads=8, layers=2), decode=rank_place(0, 4, heads=8,
                                                                               layers=2))
    assert (wide.destinations, wide.status_only) == (2, False)
    sender = wide.create_sender("2.2.2.2:1", 3)
    assert [sender.poll() for _ in range(2)] == [KVPoll.BOOTSTRAPPING, KVPoll.WAITING_FOR_INPUT]
    mla = FakeKVManager(FaultPlan(transfer_delay_polls=3),
                        place=rank_place(1, 2, heads=1, layers=2, mla=True),
                        decode=rank_place(0, 1, heads=1, layers=2, mla=True))
    assert mla.status_only
    quiet = mla.create_sender("2.2.2.2:1", 4)
    assert quiet.poll() == KVPoll.WAITING_FOR_INPUT
    quiet.init(1, 0)
    quiet.send([0], last=True)
    assert quiet.poll() == KVPoll.SUCCESS  # no transfer delay: nothing to write
